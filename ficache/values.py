"""Value types every layer of ficache shares: what a writer hands the registry
(``NewEntry``, ``NewRecord``), what a write returns, a commit as read back,
the rows of a namespaced kind as read back (``StoredRecord``,
``RecordChange`` ...: ``ficache.kind_read`` reads them), and the rank scopes.

It owns plain data and its validation only: nothing here reads or writes a
database (``ficache.registry`` does; ``ficache.registry_access`` names the part
of a registry the offline machinery uses). Format modules (``bundle``,
``v2_store``), ``records``, ``merge``, ``importing``, ``revert`` and
``history`` build and read these values without importing ``ficache.registry``,
so no module below the registry depends on it. ``ficache.registry`` re-exports
the entry and commit names here, ``ficache.records`` the record names, where
callers have always imported them.

Invariants:
- A scope is ``"shared"`` or ``"<layout>/rank<N>"`` (``validate_scope``).
- ``NewEntry`` is a named tuple whose field order is its positional form
  (``bulk_new_entry`` builds one with a single ``tuple.__new__``; the write
  path reads fields by position in its hot loop).
- ``WriteResult`` counts are of one commit; ``commit_id`` None means the
  write changed nothing and made no commit.
- A read-back row's fields stand in the order its kind's description gives
  (``Kind.stored_row``, ``Kind.change_row``; ``ficache.kinds`` checks them);
  its ``as_json`` is ``ReadBack``'s, one rendering for every kind.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, NamedTuple, cast

from ficache.fingerprint import ALL_FIELDS, Fingerprint
from ficache.flashinfer_format import KeyFields
from ficache.scopes import SHARED_SCOPE, rank_scope, validate_scope

#: ``write``'s ``expected``: (fingerprint, scope, key) -> commit id, or its pairs.
Expected = (
    Mapping[tuple[Fingerprint, str, str], int | None]
    | Sequence[tuple[tuple[Fingerprint, str, str], int | None]]
)


class NewEntry(NamedTuple):
    """One entry a writer wants stored.

    A named tuple: made by position or by name with the defaults below, and
    by bulk readers with a single ``tuple.__new__`` (``bulk_new_entry``).

    - ``tactic_json``/``policy_json``: canonical JSON text (policy None: absent).
    - ``fields``: the parsed ``key``, when the caller has it.
    - ``tuned_at``: when the value was tuned; None: now.
    - ``selection_json``: how FlashInfer chose the value (canonical JSON
      object; None: not known). Not part of the value: it is written with it
      and replaced with it.
    """

    fingerprint: Fingerprint
    key: str
    runner: str
    tactic_json: str
    policy_json: str | None = None
    scope: str = SHARED_SCOPE
    fields: KeyFields | None = None
    tuned_at: float | None = None
    selection_json: str | None = None


_tuple_new = tuple.__new__


def bulk_new_entry(
    fingerprint: Fingerprint,
    key: str,
    runner: str,
    tactic_json: str,
    policy_json: str | None,
    scope: str,
    fields: KeyFields | None,
    tuned_at: float | None,
    selection_json: str | None = None,
) -> NewEntry:
    """``NewEntry(...)`` with every field given by position, as a plain call: for bulk readers."""
    return _tuple_new(
        NewEntry,
        (
            fingerprint,
            key,
            runner,
            tactic_json,
            policy_json,
            scope,
            fields,
            tuned_at,
            selection_json,
        ),
    )


#: What a commit can be: the ``kind`` of every ``commits`` row.
COMMIT_KINDS = ("import", "startup", "merge", "revert", "prune")


@dataclass(frozen=True)
class CommitInfo:
    id: int
    created_at: float
    kind: str
    host: str
    user: str | None
    message: str | None
    world_size: int | None
    layout: str | None
    added: int
    replaced: int
    removed: int
    provenance: dict[str, Any]
    reverts_commit_id: int | None
    records_added: int = 0
    records_replaced: int = 0
    records_removed: int = 0
    protocol_added: int = 0
    protocol_replaced: int = 0
    protocol_removed: int = 0

    def as_json(self) -> dict[str, Any]:
        """Every field; the protocol record counts only when one is not 0 (a commit
        without protocol records reads as it did before ``0009_protocol_records``)."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__}
        if not (self.protocol_added or self.protocol_replaced or self.protocol_removed):
            for name in _PROTOCOL_COUNTS:
                del out[name]
        return out


_PROTOCOL_COUNTS = ("protocol_added", "protocol_replaced", "protocol_removed")


@dataclass(frozen=True)
class WriteResult:
    commit_id: int | None
    added: int = 0
    replaced: int = 0
    removed: int = 0
    unchanged: int = 0
    kept: int = 0  # values not written: the entry held another one (``keep_existing``)
    shared_written: int = 0  # of ``added + replaced``, the entries of the shared scope
    records_added: int = 0
    records_replaced: int = 0
    records_removed: int = 0
    records_unchanged: int = 0
    records_kept: int = 0
    protocol_added: int = 0
    protocol_replaced: int = 0
    protocol_removed: int = 0
    protocol_unchanged: int = 0
    protocol_kept: int = 0
    #: The one warning of a write that skipped what the registry's older schema cannot
    #: hold (``schema.SchemaFeatures.skipped``), else None.
    skipped: str | None = None

    @property
    def changed(self) -> int:
        return self.added + self.replaced + self.removed

    @property
    def records_changed(self) -> int:
        return self.records_added + self.records_replaced + self.records_removed

    @property
    def protocol_changed(self) -> int:
        return self.protocol_added + self.protocol_replaced + self.protocol_removed


#: (fingerprint, scope, namespace, record key): one record's identity.
RecordIdentity = tuple[Fingerprint, str, str, str]


@dataclass(frozen=True, slots=True)
class NewRecord:
    """One record a writer wants stored (``value_json``: canonical JSON)."""

    fingerprint: Fingerprint
    namespace: str
    key: str
    value_json: str
    scope: str = SHARED_SCOPE
    tuned_at: float | None = None  # when the value was tuned; None: now

    @property
    def identity(self) -> RecordIdentity:
        return (self.fingerprint, self.scope, self.namespace, self.key)


@dataclass(frozen=True, slots=True)
class NewProtocolRecord:
    """One FlashInfer 0.7.4 protocol record a writer wants stored (``ficache.protocol_records``).

    ``value_json``: canonical JSON; ``policy_json``: the measurement policy its
    v2 entry file carried (canonical JSON list; None: none, as FlashInfer's
    ``publish_protocol_record`` writes it).
    """

    fingerprint: Fingerprint
    namespace: str
    key: str
    value_json: str
    policy_json: str | None = None
    scope: str = SHARED_SCOPE
    tuned_at: float | None = None  # when the value was tuned; None: now

    @property
    def identity(self) -> RecordIdentity:
        return (self.fingerprint, self.scope, self.namespace, self.key)


@dataclass(frozen=True)
class NamespacedWrite:
    """What one ``Registry.write`` does to one namespaced kind: store, remove, expect.

    The one shape of every namespaced kind's write (``records.RecordWrite``,
    ``protocol_records.ProtocolWrite``); a kind adds only ``check_item``, its
    own check of one stored item. ``records`` hold ``NewRecord`` or
    ``NewProtocolRecord`` (anything with an ``identity``).
    """

    records: tuple[Any, ...] = ()
    removals: tuple[RecordIdentity, ...] = ()
    #: (identity, commit id that must hold it now, or None: absent).
    expected: tuple[tuple[RecordIdentity, int | None], ...] = ()

    #: How the kind's errors name one of its items ("record", "protocol record").
    item_name: ClassVar[str] = "record"

    @property
    def is_empty(self) -> bool:
        return not self.records and not self.removals

    def check_item(self, item: Any) -> None:
        """The kind's check of one item to store; raises ``RecordError``."""
        raise NotImplementedError

    def validate(self) -> None:
        """Check every item (``check_item``), and that none is both written and
        removed; the first problem raises (``RecordError``, ``ValueError``)."""
        seen: set[RecordIdentity] = set()
        for item in self.records:
            self.check_item(item)
            seen.add(item.identity)
        for ident in self.removals:
            if ident in seen:
                raise ValueError(f"{self.item_name} {ident[3][:80]!r} is both written and removed")


# --------------------------------------------------------------------------
# Rows of a namespaced kind as read back (``ficache.kind_read``; ``Kind.stored_row``,
# ``Kind.change_row``).

#: ``as_json``'s name of a read-back field, where it is not the field's own.
_JSON_NAMES = {
    "fingerprint_id": "fingerprint",
    "commit_id": "commit",
    "old_commit_id": "old_commit",
    "value_json": "value",
    "policy_json": "policy",
}


class ReadBack:
    """``as_json`` of a read-back row (a frozen dataclass): every field in its order,
    under its JSON name (``_JSON_NAMES``, else the field's), the fields holding
    canonical JSON text (``JSON_TEXT``) decoded, None kept."""

    JSON_TEXT: ClassVar[frozenset[str]] = frozenset()

    def as_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for name, shown, decode in _json_plan(type(self)):
            value = getattr(self, name)
            out[shown] = json.loads(value) if decode and value is not None else value
        return out


#: ``_json_plan``'s answers, by class.
_JSON_PLANS: dict[type, tuple[tuple[str, str, bool], ...]] = {}


def _json_plan(cls: type[ReadBack]) -> tuple[tuple[str, str, bool], ...]:
    """``(field, JSON name, decoded)`` of each field of ``cls``, in order."""
    plan = _JSON_PLANS.get(cls)
    if plan is None:
        plan = _JSON_PLANS[cls] = tuple(
            (f.name, _JSON_NAMES.get(f.name, f.name), f.name in cls.JSON_TEXT)
            for f in dataclasses.fields(cast(Any, cls))
        )
    return plan


@dataclass(frozen=True)
class _NamespacedRow(ReadBack):
    """The fields a current row of a namespaced kind starts with; its kind's others follow."""

    fingerprint_id: int
    scope: str
    namespace: str
    key: str
    value_json: str


@dataclass(frozen=True)
class StoredRecord(_NamespacedRow):
    """One stored record (``RECORD_KIND.stored_row``); ``value_json`` canonical JSON."""

    JSON_TEXT: ClassVar[frozenset[str]] = frozenset({"value_json"})

    commit_id: int
    tuned_at: float


@dataclass(frozen=True)
class StoredProtocolRecord(_NamespacedRow):
    """One stored protocol record (``PROTOCOL_KIND.stored_row``); value and policy
    canonical JSON (policy None: none)."""

    JSON_TEXT: ClassVar[frozenset[str]] = frozenset({"value_json", "policy_json"})

    policy_json: str | None
    commit_id: int
    tuned_at: float


@dataclass(frozen=True)
class _NamespacedChange(ReadBack):
    """The fields a change of a namespaced kind starts with: ``old`` the canonical JSON of
    the value replaced or removed, ``new`` of the value written; its kind's others follow."""

    action: str
    fingerprint_id: int
    scope: str
    namespace: str
    key: str
    old: str | None
    new: str | None


@dataclass(frozen=True)
class RecordChange(_NamespacedChange):
    """What one commit did to one record (``RECORD_KIND.change_row``)."""

    JSON_TEXT: ClassVar[frozenset[str]] = frozenset({"old", "new"})

    old_commit_id: int | None


@dataclass(frozen=True)
class ProtocolChange(_NamespacedChange):
    """What one commit did to one protocol record (``PROTOCOL_KIND.change_row``), values
    and policies as canonical JSON."""

    JSON_TEXT: ClassVar[frozenset[str]] = frozenset({"old", "new", "old_policy", "new_policy"})

    old_policy: str | None
    new_policy: str | None
    old_commit_id: int | None


def fingerprint_from_row(row: Any) -> Fingerprint:
    """The ``Fingerprint`` of one ``fingerprints`` row."""
    return Fingerprint(
        **{name: getattr(row, name) for name in ALL_FIELDS},
        measurement=getattr(row, "measurement", None) or "",
    )


__all__ = [
    "SHARED_SCOPE",
    "CommitInfo",
    "Expected",
    "NewEntry",
    "NewProtocolRecord",
    "NewRecord",
    "ProtocolChange",
    "ReadBack",
    "RecordChange",
    "RecordIdentity",
    "StoredProtocolRecord",
    "StoredRecord",
    "WriteResult",
    "bulk_new_entry",
    "fingerprint_from_row",
    "rank_scope",
    "validate_scope",
]
