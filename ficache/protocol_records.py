"""FlashInfer 0.7.4's protocol records in the registry: what one is and checking it.

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

It checks what is written; ``ficache.kind_read`` reads them back as it
reads every kind's (``stored_protocol_records`` is its reading of these),
``ficache.v2_store`` reads and writes their entry files.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

from sqlalchemy import Connection

from ficache.errors import RecordError
from ficache.flashinfer_format import (
    MAX_PROTOCOL_KEY_CHARS,
    check_protocol_identity,
    protocol_policy_json,
    protocol_value_json,
)
from ficache.kind_read import stored_rows
from ficache.kinds import PROTOCOL_KIND
from ficache.values import (
    NamespacedWrite,
    NewProtocolRecord,
    ProtocolChange,
    StoredProtocolRecord,
    validate_scope,
)

__all__ = [
    "MAX_PROTOCOL_KEY_CHARS",
    "NewProtocolRecord",
    "ProtocolChange",
    "ProtocolWrite",
    "StoredProtocolRecord",
    "check_protocol_identity",
    "protocol_policy_json",
    "protocol_value_json",
    "stored_protocol_records",
]


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
class ProtocolWrite(NamespacedWrite):
    """What one ``Registry.write`` does to protocol records: store, remove, expect."""

    records: tuple[NewProtocolRecord, ...] = ()
    item_name: ClassVar[str] = "protocol record"

    def check_item(self, item: NewProtocolRecord) -> None:
        """Check the record's identity, scope, value and policy; ``RecordError`` if bad."""
        try:
            validate_scope(item.scope)
            check_protocol_identity(item.namespace, item.key)
        except ValueError as exc:
            raise RecordError(f"protocol record refused: {exc}") from None
        _canonical(item.value_json, "value")
        if item.policy_json is not None:
            _canonical(item.policy_json, "policy")
            if not item.policy_json.startswith("["):
                raise RecordError("protocol record policy is not a JSON list")


# --------------------------------------------------------------------------
# Reading: ``ficache.kind_read`` over ``kinds.PROTOCOL_KIND`` (rows read back as
# ``StoredProtocolRecord`` and ``ProtocolChange``, ``ficache.values``).


def stored_protocol_records(conn: Connection, **filters: Any) -> Iterator[StoredProtocolRecord]:
    """Stored protocol records in (fingerprint, scope, namespace, key) order:
    ``kind_read.stored_rows`` of protocol records (``fingerprint_ids``, ``scope``,
    ``namespace``, ``limit``)."""
    return stored_rows(conn, PROTOCOL_KIND, **filters)
