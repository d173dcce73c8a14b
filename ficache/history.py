"""History: what one commit did, entry by entry (``ficache show``).

Every write is a commit with one ``entry_changes`` row per entry it added,
replaced or removed (``ficache.models``). This module reads them back.

Invariants:
- Read-only: nothing here writes, so showing a commit never changes the
  registry and works on a read-only one.
- A change shows the value it replaced (``old``: absent for ``added``) and
  the value it wrote (``new``: absent for ``removed``). Commits written
  before schema revision 0002 did not record the value they wrote; their
  ``new`` is None for every action, and ``new_known`` says so.
- A value's selection (how FlashInfer chose it; schema 0004 on) is shown
  with it in JSON (``"selection"``, only when the value has one) and is not
  part of the value: ``EntryValue``s compare without it.
- Changes are listed in a stable order: fingerprint id, scope, key; the
  commit's changes to namespaced records (``ficache.records``) follow in
  ``record_changes``, by fingerprint id, scope, namespace, key; then its
  changes to FlashInfer 0.7.4's protocol records (``protocol_changes``, in
  JSON only when it made some), in the same order.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any

from sqlalchemy.exc import DatabaseError

from ficache import schema
from ficache.errors import NotFoundError
from ficache.flashinfer_format import KeyFields, parse_key
from ficache.kind_read import changes_of
from ficache.kind_store import commit_changes
from ficache.kinds import ENTRY_KIND, PROTOCOL_KIND, RECORD_KIND
from ficache.registry_access import RegistryAccess
from ficache.values import CommitInfo, ProtocolChange, RecordChange

ACTIONS = ("added", "replaced", "removed")


@dataclass(frozen=True, order=True)
class EntryValue:
    """One value an entry can hold: runner, tactic and policy (canonical JSON text),
    with how FlashInfer chose it (``selection_json``, not part of the value)."""

    runner: str
    tactic_json: str
    policy_json: str | None = None
    selection_json: str | None = field(default=None, compare=False)

    def __str__(self) -> str:
        """The tactic, and the policy when there is one (the runner is in the key)."""
        if self.policy_json is None:
            return self.tactic_json
        return f"{self.tactic_json} policy {self.policy_json}"

    def as_json(self) -> dict[str, Any]:
        data = {
            "runner": self.runner,
            "tactic": json.loads(self.tactic_json),
            "policy": json.loads(self.policy_json) if self.policy_json is not None else None,
        }
        if self.selection_json is not None:
            data["selection"] = json.loads(self.selection_json)
        return data


@dataclass(frozen=True)
class EntryChange:
    """What one commit did to one entry."""

    action: str  # added, replaced or removed
    fingerprint_id: int
    scope: str
    key: str
    old: EntryValue | None  # the value replaced or removed
    new: EntryValue | None  # the value written
    old_commit_id: int | None  # the commit that wrote ``old``
    old_tuned_at: float | None  # when ``old`` was tuned

    @property
    def new_known(self) -> bool:
        """False for an added/replaced change recorded before the schema kept new values."""
        return self.new is not None or self.action == "removed"

    @property
    def key_fields(self) -> KeyFields | None:
        """The key's op, runner, shapes and extras (None for a key that does not parse)."""
        try:
            return parse_key(self.key)
        except ValueError:  # stored keys were parsed when written; never expected
            return None

    def as_json(self) -> dict[str, Any]:
        fields = self.key_fields
        return {
            "action": self.action,
            "fingerprint": self.fingerprint_id,
            "scope": self.scope,
            "op": fields.op if fields is not None else None,
            "shapes": [list(s) for s in fields.shapes] if fields is not None else None,
            "extras": fields.extras if fields is not None else None,
            "key": self.key,
            "old": self.old.as_json() if self.old is not None else None,
            "new": self.new.as_json() if self.new is not None else None,
            "old_commit": self.old_commit_id,
            "old_tuned_at": self.old_tuned_at,
        }


@dataclass(frozen=True)
class CommitDetails:
    """One commit with its provenance and every change it made."""

    commit: CommitInfo
    changes: tuple[EntryChange, ...]
    record_changes: tuple[RecordChange, ...] = ()
    protocol_changes: tuple[ProtocolChange, ...] = ()

    def count(self, action: str) -> int:
        return sum(1 for c in self.changes if c.action == action)

    def as_json(self) -> dict[str, Any]:
        out = {
            "commit": self.commit.as_json(),
            "changes": [c.as_json() for c in self.changes],
            "record_changes": [c.as_json() for c in self.record_changes],
        }
        if self.protocol_changes:
            out["protocol_changes"] = [c.as_json() for c in self.protocol_changes]
        return out


@dataclass(frozen=True)
class ChangeStat:
    """How many changes of one kind one commit made to one op (entries) or namespace."""

    kind: str  # "entry", "record" or "protocol record"
    group: str  # the op of an entry's key (the key itself when it does not parse), a namespace
    added: int = 0
    replaced: int = 0
    removed: int = 0

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def change_stat(details: CommitDetails) -> list[ChangeStat]:
    """``show --stat``: a commit's changes counted per kind and op or namespace, in that order."""
    counts: dict[tuple[str, str], dict[str, int]] = {}

    def count(kind: str, group: str, action: str) -> None:
        counts.setdefault((kind, group), {"added": 0, "replaced": 0, "removed": 0})[action] += 1

    for change in details.changes:
        fields = change.key_fields
        count("entry", fields.op if fields is not None else change.key, change.action)
    for kind, changes in (
        ("record", details.record_changes),
        ("protocol record", details.protocol_changes),
    ):
        for namespaced in changes:
            count(kind, namespaced.namespace, namespaced.action)
    order = {"entry": 0, "record": 1, "protocol record": 2}
    return [
        ChangeStat(kind, group, **actions)
        for (kind, group), actions in sorted(
            counts.items(), key=lambda i: (order[i[0][0]], i[0][1])
        )
    ]


def _value(
    runner: str | None, tactic: str | None, policy: str | None, selection: str | None = None
) -> EntryValue | None:
    if runner is None or tactic is None:
        return None
    return EntryValue(runner, tactic, policy, selection)


def commit_details(registry: RegistryAccess, commit_id: int) -> CommitDetails:
    """The commit ``commit_id`` and its changes; ``NotFoundError`` when there is none."""
    found = registry.log(None, commit_id=commit_id)
    if not found:
        raise NotFoundError(f"no commit {commit_id}; see `ficache log`")
    try:
        with registry.engine.connect() as conn:
            changes = tuple(
                EntryChange(
                    r.action,
                    r.fingerprint_id,
                    r.scope,
                    r.key,
                    _value(r.old_runner, r.old_tactic, r.old_policy, r.old_selection),
                    _value(r.new_runner, r.new_tactic, r.new_policy, r.new_selection),
                    r.old_commit_id,
                    r.old_tuned_at,
                )
                for r in commit_changes(conn, ENTRY_KIND, commit_id)
            )
            records = changes_of(conn, RECORD_KIND, commit_id)
            protocol = changes_of(conn, PROTOCOL_KIND, commit_id)
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, registry.location) from None
    return CommitDetails(found[0], changes, records, protocol)


__all__ = ["ACTIONS", "CommitDetails", "EntryChange", "EntryValue", "commit_details"]
