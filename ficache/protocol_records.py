"""FlashInfer 0.7.4's protocol records in the registry: what one is, writing it, reading it.

FlashInfer 0.7.4 protocols (the MoE-EP MegaMoE ones first) keep tuning
results with ``AutoTuner.publish_protocol_record(namespace, key, value, *,
persist)`` and read them with ``get_protocol_records(namespace)``. FlashInfer
holds them in memory per winner-cache identity and persists them only in a
v2 managed store, as entries keyed ``('__protocol__', namespace, key)`` whose
runner is the namespace and whose tactic is the value; never in a v1 cache
file's ``_records``. ficache keeps them as a kind of stored result of their own
(``ficache.kinds.PROTOCOL_KIND``, tables ``protocol_records`` /
``protocol_record_changes``): one row per (fingerprint, scope, namespace,
key), the value as canonical JSON text and the measurement policy the entry
file carried (``profiling_policy``; none for what ``publish_protocol_record``
writes), by ``policies`` id as entries hold theirs.

Invariants:
- A protocol record never collides with a v1 record: other tables, another
  kind, another writer's item (``NewProtocolRecord``). No export writes one
  into a v1 file's ``_records``; only v2 stores and bundles carry them.
- They are stored shared (``SHARED_SCOPE``): FlashInfer's store is one per
  environment, not per rank. ``ProtocolWrite.validate`` accepts another scope
  (a revert puts back what was stored) but no source writes one.
- Every item is checked before the write's transaction
  (``ProtocolWrite.validate``): a namespace FlashInfer accepts (a non-empty
  string, here at most ``MAX_NAMESPACE_CHARS``), a string key of at most
  ``MAX_PROTOCOL_KEY_CHARS``, a value that is the canonical JSON of a value
  ``publish_protocol_record`` could have written (finite numbers, at most
  ``MAX_RECORD_DEPTH`` deep), a policy that is a canonical JSON list. A bad
  one raises ``RecordError`` and nothing is written.
- Writes go through ``Registry.write``'s one transaction and the store
  machinery (``ficache.kind_store`` over ``PROTOCOL_KIND``), so merge, prune,
  revert, history and verify's replay treat them as every kind.

It reads only; ``ficache.v2_store`` reads and writes their entry files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from ficache.errors import RecordError
from ficache.flashinfer_format import (
    MAX_PROTOCOL_KEY_CHARS,
    canonical_json,
    check_protocol_identity,
    protocol_policy_json,
    protocol_value_json,
)
from ficache.kind_store import commit_changes
from ficache.kinds import PROTOCOL_KIND
from ficache.models import PROTOCOL_RECORDS as P
from ficache.models import policy_text
from ficache.values import NewProtocolRecord, RecordIdentity, validate_scope

__all__ = [
    "MAX_PROTOCOL_KEY_CHARS",
    "NewProtocolRecord",
    "ProtocolChange",
    "ProtocolWrite",
    "StoredProtocolRecord",
    "check_protocol_identity",
    "protocol_policy_json",
    "protocol_value_json",
]

#: ``{namespace: {key: canonical JSON value}}``: what one rank publishes.
ProtocolMap = dict[str, dict[str, str]]


def _canonical(text: Any, what: str) -> None:
    if not isinstance(text, str):
        raise RecordError(f"protocol record {what} is not JSON text")
    try:
        again = protocol_value_json(json.loads(text))
    except ValueError as exc:
        raise RecordError(f"protocol record {what} {text[:80]!r} refused: {exc}") from None
    if again != text:
        raise RecordError(f"protocol record {what} {text[:80]!r} is not canonical JSON")


@dataclass(frozen=True)
class ProtocolWrite:
    """What one ``Registry.write`` does to protocol records: store, remove, expect."""

    records: tuple[NewProtocolRecord, ...] = ()
    removals: tuple[RecordIdentity, ...] = ()
    #: (identity, commit id that must hold it now, or None: absent).
    expected: tuple[tuple[RecordIdentity, int | None], ...] = ()

    @property
    def is_empty(self) -> bool:
        return not self.records and not self.removals

    def validate(self) -> None:
        """Check identities, scopes, values and policies; ``RecordError`` for the first bad one."""
        for r in self.records:
            try:
                validate_scope(r.scope)
                check_protocol_identity(r.namespace, r.key)
            except ValueError as exc:
                raise RecordError(f"protocol record refused: {exc}") from None
            _canonical(r.value_json, "value")
            if r.policy_json is not None:
                _canonical(r.policy_json, "policy")
                if not r.policy_json.startswith("["):
                    raise RecordError("protocol record policy is not a JSON list")


# --------------------------------------------------------------------------
# Reading.


@dataclass(frozen=True)
class StoredProtocolRecord:
    fingerprint_id: int
    scope: str
    namespace: str
    key: str
    value_json: str
    policy_json: str | None
    commit_id: int
    tuned_at: float

    def as_json(self) -> dict[str, Any]:
        return {
            "fingerprint": self.fingerprint_id,
            "scope": self.scope,
            "namespace": self.namespace,
            "key": self.key,
            "value": json.loads(self.value_json),
            "policy": json.loads(self.policy_json) if self.policy_json is not None else None,
            "commit": self.commit_id,
            "tuned_at": self.tuned_at,
        }


def stored_protocol_records(
    conn: Connection,
    *,
    fingerprint_ids: Sequence[int] | None = None,
    scope: str | None = None,
    namespace: str | None = None,
) -> Iterator[StoredProtocolRecord]:
    """Stored protocol records in (fingerprint, scope, namespace, key) order."""
    query = select(
        P.c.fingerprint_id,
        P.c.scope,
        P.c.namespace,
        P.c.key,
        P.c.value,
        policy_text(P.c.policy_id),
        P.c.commit_id,
        P.c.tuned_at,
    )
    if fingerprint_ids is not None:
        query = query.where(P.c.fingerprint_id.in_(list(fingerprint_ids)))
    if scope is not None:
        query = query.where(P.c.scope == scope)
    if namespace is not None:
        query = query.where(P.c.namespace == namespace)
    query = query.order_by(P.c.fingerprint_id, P.c.scope, P.c.namespace, P.c.key)
    for row in conn.execute(query):
        yield StoredProtocolRecord(*row)


def protocol_values(
    conn: Connection, fingerprint_ids: Sequence[int] | None = None
) -> list[tuple[int, str, str, str, str, str | None, float]]:
    """``(fingerprint_id, scope, namespace, key, value, policy, tuned_at)``, as bundles,
    merges and v2 exports copy them."""
    return [
        (r.fingerprint_id, r.scope, r.namespace, r.key, r.value_json, r.policy_json, r.tuned_at)
        for r in stored_protocol_records(conn, fingerprint_ids=fingerprint_ids)
    ]


def slice_protocol_records(
    conn: Connection, fingerprint_ids: Sequence[int], scopes: Sequence[str]
) -> ProtocolMap:
    """``{namespace: {key: value}}`` one rank publishes: its scopes' rows, earlier fingerprints
    and later scopes winning (as ``records.slice_records``)."""
    out: ProtocolMap = {}
    for fid in reversed(list(fingerprint_ids)):
        for scope in scopes:
            rows = conn.execute(
                select(P.c.namespace, P.c.key, P.c.value).where(
                    P.c.fingerprint_id == fid, P.c.scope == scope
                )
            )
            for ns, key, value in rows:
                out.setdefault(ns, {})[key] = value
    return out


def protocol_counts(conn: Connection) -> tuple[tuple[int, str, int], ...]:
    """``(fingerprint id, namespace, protocol records)``, every stored namespace."""
    rows = conn.execute(
        select(P.c.fingerprint_id, P.c.namespace, func.count())
        .group_by(P.c.fingerprint_id, P.c.namespace)
        .order_by(P.c.fingerprint_id, P.c.namespace)
    )
    return tuple((int(fid), ns, int(n)) for fid, ns, n in rows)


@dataclass(frozen=True)
class ProtocolChange:
    """What one commit did to one protocol record (values and policies as canonical JSON)."""

    action: str
    fingerprint_id: int
    scope: str
    namespace: str
    key: str
    old: str | None
    new: str | None
    old_policy: str | None
    new_policy: str | None
    old_commit_id: int | None

    def as_json(self) -> dict[str, Any]:
        def load(text: str | None) -> Any:
            return json.loads(text) if text is not None else None

        return {
            "action": self.action,
            "fingerprint": self.fingerprint_id,
            "scope": self.scope,
            "namespace": self.namespace,
            "key": self.key,
            "old": load(self.old),
            "new": load(self.new),
            "old_policy": load(self.old_policy),
            "new_policy": load(self.new_policy),
            "old_commit": self.old_commit_id,
        }


def protocol_changes(conn: Connection, commit_id: int) -> tuple[ProtocolChange, ...]:
    """What commit ``commit_id`` did to protocol records, by identity."""
    return tuple(
        ProtocolChange(
            ch.action,
            ch.fingerprint_id,
            ch.scope,
            ch.namespace,
            ch.key,
            ch.old_value,
            ch.new_value,
            ch.old_policy,
            ch.new_policy,
            ch.old_commit_id,
        )
        for ch in commit_changes(conn, PROTOCOL_KIND, commit_id)
    )


def canonical_policy(policy: Sequence[Any] | None) -> str | None:
    """A policy tuple or list as canonical JSON (None: none)."""
    return canonical_json(list(policy)) if policy is not None else None
