"""The kinds of stored result, one frozen description each: what the store machinery takes.

ficache stores three kinds of tuned result: FlashInfer entries (``entries`` /
``entry_changes``), namespaced records (``records`` / ``record_changes``) and
FlashInfer 0.7.4's protocol records (``protocol_records`` /
``protocol_record_changes``), see ``ficache.models``. Each is described here once, as a ``Kind``: its
current-row table and its change table, which columns name a row, which hold
its value, which travel with the value without being part of it, which are
derived, how a current row maps onto a change row, and which commit columns
count its changes, and the classes its rows read back as. Staging a write,
checking expected commits, applying, reading history, revert, prune, merge
planning and verify's replay are written once, over a ``Kind``
(``ficache.kind_store``, ``ficache.kind_merge``), and so is reading a kind's
rows back (``ficache.kind_read``); they never name a kind's columns themselves.

It owns the descriptions and the pure helpers that read a row by them
(``Kind.identity_of`` ...); it executes no SQL and imports only the models.

Invariants:
- A row's identity is ``(fingerprint_id, scope, *Kind.identity)``; it is
  unique in ``Kind.rows``, and its last column is ``key`` (queries chunk by
  fingerprint and key).
- Two values are equal exactly when their ``Kind.values`` columns are equal.
  ``Kind.carried`` columns (``tuned_at``; an entry's ``selection``) travel
  with a value: written with it, kept when an equal value arrives, replaced
  with it, kept in the change rows, restored by a revert. They never make two
  values differ, and never make a conflict.
- A value column named in ``Kind.policy_columns`` holds a ``policies`` id;
  the value a writer hands over holds the policy's canonical JSON text in
  its place (``ficache.policies`` maps one to the other, one text one id),
  so comparing ids is comparing texts.
- ``Kind.derived`` columns are computed from the identity when a row is
  written (an entry's ``op`` is read from its key) and never compared.
- A change row holds the identity, the ``action`` (added, replaced,
  removed), the state it replaced (``Kind.old``: value, carried columns and
  the commit that had written it; NULL for ``added``) and the value it wrote
  (``Kind.new``; NULL for ``removed``).
- Every ``rows`` table has ``id``, ``commit_id`` (the commit that wrote the
  current value) and ``updated_at`` (when this registry wrote it); a current
  state is read flat as ``(id, commit_id, *values, *carried)``
  (``Kind.state_columns``; ``CurrentRow`` names its parts).
- A commit counts each kind's changes in its own columns (``Kind.counts``);
  ``WriteResult`` names them with ``Kind.result_prefix``.

Adding a kind of stored result = a description here (with the classes its
rows read back as, in ``ficache.values``) + a migration (its two tables and
count columns) + its format code (reading and rendering it). No copy of the
machinery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, NamedTuple

from sqlalchemy import Column, Table

from ficache.errors import FicacheError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_key
from ficache.models import (
    ENTRIES,
    ENTRY_CHANGES,
    PROTOCOL_RECORD_CHANGES,
    PROTOCOL_RECORDS,
    RECORD_CHANGES,
    RECORDS,
)
from ficache.values import (
    NewEntry,
    NewProtocolRecord,
    NewRecord,
    ProtocolChange,
    RecordChange,
    StoredProtocolRecord,
    StoredRecord,
)

__all__ = [
    "ACTIONS",
    "ENTRY_KIND",
    "KINDS",
    "PROTOCOL_KIND",
    "RECORD_KIND",
    "STORED_KINDS",
    "CurrentRow",
    "Kind",
    "StoredChange",
    "kind_named",
]

#: What a change does to one row, in the order commits count them.
ACTIONS = ("added", "replaced", "removed")


class CurrentRow(NamedTuple):
    """A current row's state as the store machinery reads it (``Kind.state_columns``).

    ``value`` and ``carried`` are the kind's ``values`` and ``carried``
    columns, in the description's order (policies by id).
    """

    row_id: int
    commit_id: int
    value: tuple[Any, ...]
    carried: tuple[Any, ...]


class StoredChange(NamedTuple):
    """One change row read by its kind's description (``Kind.change_of``).

    ``identity`` is the kind's identity columns after fingerprint and scope;
    ``old_value``/``new_value`` are None where the change holds none
    (``added`` has no old value, ``removed`` no new one).
    """

    change_id: int
    commit_id: int
    fingerprint_id: int
    scope: str
    identity: tuple[Any, ...]
    action: str
    old_value: tuple[Any, ...] | None
    old_carried: tuple[Any, ...]
    old_commit_id: int | None
    new_value: tuple[Any, ...] | None
    new_carried: tuple[Any, ...]


@dataclass(frozen=True)
class Kind:
    """One kind of stored result, described by its tables and columns (see the module docstring)."""

    #: Singular, as messages and ``RevertConflict.kind`` name one: "entry", "record",
    #: "protocol record".
    name: str
    #: Plural, as messages count them: "entries", "records".
    plural: str
    #: Its current rows, one per identity.
    rows: Table
    #: Its change log, one row per change a commit made.
    changes: Table
    #: Identity columns after ``fingerprint_id`` and ``scope``, ``key`` last.
    identity: tuple[str, ...]
    #: Columns of the value; two values are equal when these are.
    values: tuple[str, ...]
    #: Columns that travel with a value but are not part of it.
    carried: tuple[str, ...]
    #: Columns computed from the identity when a row is written (never compared).
    derived: tuple[str, ...]
    #: Value columns holding a ``policies`` id (the writer's item holds the text).
    policy_columns: tuple[str, ...]
    #: Current-row column -> change column of the state a change replaced
    #: (values, carried, ``commit_id`` -> ``old_commit_id``).
    old: tuple[tuple[str, str], ...]
    #: Current-row column -> change column of the value a change wrote.
    new: tuple[tuple[str, str], ...]
    #: Action -> the ``commits`` column counting this kind's changes of it.
    counts: tuple[tuple[str, str], ...]
    #: Prefix of this kind's fields in ``WriteResult`` ("", "records_", "protocol_").
    result_prefix: str
    #: Attribute names, on a writer's item (``NewEntry``, ``NewRecord``), of the
    #: identity (after fingerprint and scope), the value and the carried columns,
    #: in the order of ``identity``, ``values`` and ``carried``.
    item_identity: tuple[str, ...]
    item_values: tuple[str, ...]
    item_carried: tuple[str, ...]
    #: ``make_item(fingerprint, scope, identity, value, carried)``: a writer's item
    #: (policies as text), as a revert writes back a value a change replaced.
    make_item: Callable[[Fingerprint, str, tuple[Any, ...], tuple[Any, ...], tuple[Any, ...]], Any]
    #: ``derive(items)``: the ``derived`` columns' values of each of a write's items, in
    #: order, before the write's transaction (``FicacheError`` when an item cannot be
    #: stored); None: no derived columns. One call per write, not per item.
    derive: Callable[[Iterable[Any]], list[tuple[Any, ...]]] | None = None
    #: Carried columns written as the write's time when the item holds None.
    now_if_none: tuple[str, ...] = ("tuned_at",)
    #: The frozen dataclass a current row reads back as (``ficache.kind_read``), made by
    #: position from ``fingerprint_id, scope, *identity, *values, commit_id, *carried``
    #: (policies as text) and naming them ``fingerprint_id``, ``scope``, ``item_identity``,
    #: ``item_values``, ``commit_id``, ``item_carried``; None: the kind has its own reader
    #: (entries: ``ficache.stored_entries``).
    stored_row: type | None = None
    #: The frozen dataclass a change row reads back as (``ficache.kind_read``, history),
    #: made by position from ``action, fingerprint_id, scope, *identity``, then for each
    #: ``values`` column the value it replaced and the value it wrote, then
    #: ``old_commit_id``; None: the kind has its own (entries: ``history.EntryChange``).
    change_row: type | None = None

    def __post_init__(self) -> None:
        row_columns = set(self.rows.c.keys())
        change_columns = set(self.changes.c.keys())
        named = {"fingerprint_id", "scope", *self.identity, *self.values, *self.carried}
        assert self.identity[-1] == "key", "an identity ends with key"
        assert named | set(self.derived) <= row_columns, f"{self.name}: unknown row column"
        assert {"fingerprint_id", "scope", *self.identity, "action", "commit_id"} <= change_columns
        assert tuple(c for c, _ in self.old) == (*self.values, *self.carried, "commit_id")
        new = tuple(c for c, _ in self.new)
        assert new[: len(self.values)] == self.values and set(new) <= {*self.values, *self.carried}
        assert (self.derive is None) == (not self.derived)
        assert set(self.now_if_none) <= set(self.carried)
        assert {"id", "commit_id", "updated_at"} <= row_columns
        assert {c for _, c in (*self.old, *self.new)} <= change_columns
        assert tuple(a for a, _ in self.counts) == ACTIONS
        assert set(self.policy_columns) <= set(self.values)
        assert len(self.item_identity) == len(self.identity)
        assert len(self.item_values) == len(self.values)
        assert len(self.item_carried) == len(self.carried)
        if self.stored_row is not None:
            assert _field_names(self.stored_row) == (
                *("fingerprint_id", "scope", *self.item_identity, *self.item_values),
                *("commit_id", *self.item_carried),
            ), f"{self.name}: stored_row's fields"
        if self.change_row is not None:
            width = 3 + len(self.identity) + 2 * len(self.values) + 1
            assert len(_field_names(self.change_row)) == width, f"{self.name}: change_row's fields"

    # -- columns ------------------------------------------------------------

    @property
    def identity_columns(self) -> tuple[str, ...]:
        """Every column naming one row: ``fingerprint_id``, ``scope``, then ``identity``."""
        return ("fingerprint_id", "scope", *self.identity)

    @property
    def state_columns(self) -> tuple[Column[Any], ...]:
        """``rows`` columns a current state is read from: id, commit, values, carried."""
        c = self.rows.c
        return (c.id, c.commit_id, *(c[n] for n in self.values), *(c[n] for n in self.carried))

    def old_column(self, row_column: str) -> str:
        """The change column holding ``row_column`` of the state a change replaced."""
        return dict(self.old)[row_column]

    def new_column(self, row_column: str) -> str | None:
        """The change column holding ``row_column`` of the value written; None: not kept."""
        return dict(self.new).get(row_column)

    def count_column(self, action: str) -> str:
        """The ``commits`` column counting this kind's ``action`` changes."""
        return dict(self.counts)[action]

    def result_field(self, what: str) -> str:
        """``WriteResult``'s field for this kind's ``what`` (added ... unchanged, kept)."""
        return self.result_prefix + what

    # -- reading rows by the description ------------------------------------

    def identity_of(self, row: Any) -> tuple[Any, ...]:
        """``(fingerprint_id, scope, *identity)`` of a current or change row (by attribute)."""
        return tuple(getattr(row, name) for name in self.identity_columns)

    def value_of(self, row: Any) -> tuple[Any, ...]:
        """The value of a current row (by attribute), policies by id."""
        return tuple(getattr(row, name) for name in self.values)

    def carried_of(self, row: Any) -> tuple[Any, ...]:
        return tuple(getattr(row, name) for name in self.carried)

    def state_of(self, row: Any) -> CurrentRow:
        """A flat state ``(id, commit_id, *values, *carried)`` (``state_columns``), as a ``CurrentRow``."""
        n = len(self.values)
        return CurrentRow(row[0], row[1], tuple(row[2 : 2 + n]), tuple(row[2 + n :]))

    def change_of(self, row: Any) -> StoredChange:
        """A whole change row (``select(kind.changes)``), read by the description."""
        old = dict(self.old)
        new = dict(self.new)
        action = row.action
        old_value = tuple(getattr(row, old[c]) for c in self.values) if action != "added" else None
        new_value = (
            tuple(getattr(row, new[c]) for c in self.values) if action != "removed" else None
        )
        return StoredChange(
            row.id,
            row.commit_id,
            row.fingerprint_id,
            row.scope,
            tuple(getattr(row, name) for name in self.identity),
            action,
            old_value,
            tuple(getattr(row, old[c]) for c in self.carried),
            row.old_commit_id,
            new_value,
            tuple(getattr(row, new[c]) if c in new else None for c in self.carried),
        )

    # -- a writer's items ------------------------------------------------------

    def item_identity_of(self, item: Any) -> tuple[Any, ...]:
        """``(fingerprint, scope, *identity)`` of a writer's item (a ``Fingerprint`` first)."""
        return (item.fingerprint, item.scope, *(getattr(item, n) for n in self.item_identity))

    def item_value_of(self, item: Any) -> tuple[Any, ...]:
        """The value of a writer's item, policies as text."""
        return tuple(getattr(item, n) for n in self.item_values)

    def item_carried_of(self, item: Any) -> tuple[Any, ...]:
        return tuple(getattr(item, n) for n in self.item_carried)

    def same_value(self, a: tuple[Any, ...], b: tuple[Any, ...]) -> bool:
        """Whether two values (``values`` order, policies both by id or both by text) are equal."""
        return tuple(a) == tuple(b)


def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls))


def _entry_item(
    fp: Fingerprint,
    scope: str,
    ident: tuple[Any, ...],
    value: tuple[Any, ...],
    carried: tuple[Any, ...],
) -> NewEntry:
    (key,) = ident
    runner, tactic, policy = value
    tuned_at, selection = carried
    return NewEntry(fp, key, runner, tactic, policy, scope, None, tuned_at, selection)


def _entries_derived(entries: Iterable[NewEntry]) -> list[tuple[str]]:
    """Each entry's ``op``, read from its parsed key (``NewEntry.fields``) or by parsing it."""
    # entry[6] is NewEntry.fields (its [0] KeyFields.op), entry[1] its key: the bulk path.
    return [(e[6][0],) if e[6] is not None else _op_of_key(e[1]) for e in entries]


@lru_cache(maxsize=4096)
def _op_of_key(key: str) -> tuple[str]:
    """The op of a key that came without its parsed fields (parsed once: the same
    key is often written in several scopes)."""
    try:
        return (parse_key(key).op,)
    except ValueError as exc:
        raise FicacheError(f"entry key {key[:80]!r} is not a FlashInfer key: {exc}") from None


def _record_item(
    fp: Fingerprint,
    scope: str,
    ident: tuple[Any, ...],
    value: tuple[Any, ...],
    carried: tuple[Any, ...],
) -> NewRecord:
    namespace, key = ident
    (value_json,) = value
    (tuned_at,) = carried
    return NewRecord(fp, namespace, key, value_json, scope, tuned_at)


#: FlashInfer entries: one tactic of one file key (``ficache.models.EntryRow``).
ENTRY_KIND = Kind(
    name="entry",
    plural="entries",
    rows=ENTRIES,
    changes=ENTRY_CHANGES,
    identity=("key",),
    values=("runner", "tactic", "policy_id"),
    carried=("tuned_at", "selection"),
    derived=("op",),
    policy_columns=("policy_id",),
    old=(
        ("runner", "old_runner"),
        ("tactic", "old_tactic"),
        ("policy_id", "old_policy_id"),
        ("tuned_at", "old_tuned_at"),
        ("selection", "old_selection"),
        ("commit_id", "old_commit_id"),
    ),
    new=(
        ("runner", "new_runner"),
        ("tactic", "new_tactic"),
        ("policy_id", "new_policy_id"),
        ("selection", "new_selection"),
    ),
    counts=(("added", "added"), ("replaced", "replaced"), ("removed", "removed")),
    result_prefix="",
    item_identity=("key",),
    item_values=("runner", "tactic_json", "policy_json"),
    item_carried=("tuned_at", "selection_json"),
    make_item=_entry_item,
    derive=_entries_derived,
)

#: Namespaced records: one JSON value of one (namespace, key) (``ficache.models.RecordRow``).
RECORD_KIND = Kind(
    name="record",
    plural="records",
    rows=RECORDS,
    changes=RECORD_CHANGES,
    identity=("namespace", "key"),
    values=("value",),
    carried=("tuned_at",),
    derived=(),
    policy_columns=(),
    old=(
        ("value", "old_value"),
        ("tuned_at", "old_tuned_at"),
        ("commit_id", "old_commit_id"),
    ),
    new=(("value", "new_value"),),
    counts=(
        ("added", "records_added"),
        ("replaced", "records_replaced"),
        ("removed", "records_removed"),
    ),
    result_prefix="records_",
    item_identity=("namespace", "key"),
    item_values=("value_json",),
    item_carried=("tuned_at",),
    make_item=_record_item,
    stored_row=StoredRecord,
    change_row=RecordChange,
)


def _protocol_item(
    fp: Fingerprint,
    scope: str,
    ident: tuple[Any, ...],
    value: tuple[Any, ...],
    carried: tuple[Any, ...],
) -> NewProtocolRecord:
    namespace, key = ident
    value_json, policy_json = value
    (tuned_at,) = carried
    return NewProtocolRecord(fp, namespace, key, value_json, policy_json, scope, tuned_at)


#: FlashInfer 0.7.4 protocol records: one JSON value of one (namespace, key), with the
#: measurement policy of its v2 entry file (``ficache.models.ProtocolRecordRow``).
PROTOCOL_KIND = Kind(
    name="protocol record",
    plural="protocol records",
    rows=PROTOCOL_RECORDS,
    changes=PROTOCOL_RECORD_CHANGES,
    identity=("namespace", "key"),
    values=("value", "policy_id"),
    carried=("tuned_at",),
    derived=(),
    policy_columns=("policy_id",),
    old=(
        ("value", "old_value"),
        ("policy_id", "old_policy_id"),
        ("tuned_at", "old_tuned_at"),
        ("commit_id", "old_commit_id"),
    ),
    new=(("value", "new_value"), ("policy_id", "new_policy_id")),
    counts=(
        ("added", "protocol_added"),
        ("replaced", "protocol_replaced"),
        ("removed", "protocol_removed"),
    ),
    result_prefix="protocol_",
    item_identity=("namespace", "key"),
    item_values=("value_json", "policy_json"),
    item_carried=("tuned_at",),
    make_item=_protocol_item,
    stored_row=StoredProtocolRecord,
    change_row=ProtocolChange,
)

#: Every kind, in the order a commit writes, shows and reverts them.
KINDS: tuple[Kind, ...] = (ENTRY_KIND, RECORD_KIND, PROTOCOL_KIND)
#: The same tuple, by the name the machinery's loops use: a new kind is one more description.
STORED_KINDS = KINDS

_BY_NAME: Mapping[str, Kind] = {k.name: k for k in KINDS}


def kind_named(name: str) -> Kind:
    """The kind called ``name`` ("entry", "record", "protocol record"); ``KeyError`` for another."""
    return _BY_NAME[name]
