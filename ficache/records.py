"""FlashInfer's namespaced records in the registry: what one is and checking it.

A FlashInfer cache file may hold, besides tactics, ``"_records": {namespace:
{record key: JSON value}}`` (``AutoTuner.publish_namespaced_records`` /
``get_namespaced_records``; FlashInfer's fused-MoE dynamic-allocation runtime
keeps its tuned plans in namespace ``trtllm_moe_da``). They are tuning
results too, and ficache keeps them like entries: one ``records`` row per
(fingerprint, scope, namespace, record key), the value as canonical JSON
text (``flashinfer_format.record_value_json``), and one ``record_changes``
row per change (``ficache.models``).

Invariants:
- Records are written only inside ``Registry.write``'s transaction
  (``ficache.kind_store``'s ``stage`` then ``apply`` over
  ``ficache.kinds.RECORD_KIND``, the entries' one path), so a write that changes records is one commit
  with its provenance, the same commit as the entries it writes with them;
  the commit counts its record changes (``records_added``,
  ``records_replaced``, ``records_removed``). A write that changes neither
  entries nor records makes no commit. ``Registry.revert`` undoes a commit's
  record changes with its entry changes, as one ``Registry.write``
  (``ficache.revert``), and refuses when a later commit changed one of its
  records. A prune removes the records its criteria match in the prune's
  one commit (``kind_store.prune_candidates``,
  ``kind_store.stage_planned_removals``; see ``Registry.plan_prune``), as ``removed`` record changes a revert restores.
- A record equal to the stored one (same canonical JSON) is unchanged, not
  replaced; ``keep_existing`` keeps a stored value that differs; ``expected``
  commit ids are checked under the write lock, as for entries.
- Scopes are the entries' (``shared`` or ``<layout>/rank<N>``). A rank's
  records are the shared ones overlaid, key by key within a namespace, by
  its own scope's (``Registry.slice_records``); earlier fingerprints win,
  as in ``Registry.slice_rows``.
- Every value is validated before the transaction: canonical JSON of a value
  JSON carries exactly, at most ``MAX_RECORD_DEPTH`` deep; namespaces as
  FlashInfer demands. A bad record raises ``RecordError`` and nothing is
  written.

It does not read, merge or verify records: ``ficache.kind_read`` reads them
back as it reads every kind's (``list_records`` is its listing of records),
``ficache.merge`` plans their merges with the entries' (``ficache.kind_merge``,
one machinery for every kind), and ``ficache.verify`` replays their change
log as it replays the entries'.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ficache.errors import RecordError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import (
    MAX_RECORD_DEPTH,
    check_namespace,
    record_value_json,
)
from ficache.kind_read import list_stored
from ficache.kinds import RECORD_KIND
from ficache.values import (
    NamespacedWrite,
    NewRecord,
    RecordChange,
    RecordIdentity,
    StoredRecord,
    validate_scope,
)

__all__ = [
    "MAX_RECORD_DEPTH",
    "NewRecord",
    "RecordChange",
    "RecordIdentity",
    "RecordWrite",
    "StoredRecord",
    "canonical_value",
    "list_records",
]


def canonical_value(value_json: str) -> str:
    """``value_json`` checked to be a record value's canonical JSON; ``RecordError`` if not."""
    try:
        text = record_value_json(json.loads(value_json))
    except (ValueError, RecursionError, TypeError) as exc:
        detail = str(exc) if isinstance(exc, ValueError) else "nested too deeply"
        raise RecordError(f"record value {str(value_json)[:80]!r} refused: {detail}") from None
    if text != value_json:
        raise RecordError(f"record value {value_json[:80]!r} is not canonical JSON")
    return text


@dataclass(frozen=True)
class RecordWrite(NamespacedWrite):
    """What one ``Registry.write`` does to records: store, remove, expect."""

    records: tuple[NewRecord, ...] = ()

    def check_item(self, item: NewRecord) -> None:
        """Check the record's scope, namespace, key and value; ``RecordError`` if bad."""
        try:
            validate_scope(item.scope)
            check_namespace(item.namespace)
        except ValueError as exc:
            raise RecordError(f"record {item.key[:80]!r} refused: {exc}") from None
        if not isinstance(item.key, str) or not item.key:
            raise RecordError(f"a record key of namespace {item.namespace!r} is empty")
        canonical_value(item.value_json)


def records_of_file(
    fingerprint: Fingerprint,
    rows: Iterable[tuple[str, str, str]],
    scope: str,
    tuned_at: float | None = None,
) -> list[NewRecord]:
    """``NewRecord`` of a parsed file's ``CacheFile.record_rows``."""
    return [NewRecord(fingerprint, ns, key, value, scope, tuned_at) for ns, key, value in rows]


def records_of_map(
    fingerprint: Fingerprint, by_ns: Mapping[str, Mapping[str, Any]], scope: str
) -> list[NewRecord]:
    """``NewRecord`` of parsed ``{namespace: {key: value}}``; ``ValueError`` for a bad one."""
    out = []
    for ns, by_key in sorted(by_ns.items()):
        check_namespace(ns)
        for key, value in sorted(by_key.items()):
            out.append(NewRecord(fingerprint, ns, key, record_value_json(value), scope))
    return out


# --------------------------------------------------------------------------
# Writing: ``ficache.kind_store`` over ``kinds.RECORD_KIND`` (inside Registry.write's
# transaction).


# --------------------------------------------------------------------------
# Reading: ``ficache.kind_read`` over ``kinds.RECORD_KIND`` (rows read back as
# ``StoredRecord`` and ``RecordChange``, ``ficache.values``).


def list_records(registry: Any, **filters: Any) -> list[StoredRecord]:
    """Stored records of ``registry`` (a ``Registry``), in (fingerprint, scope, namespace,
    key) order: ``kind_read.list_stored`` of records (``fingerprint_ids``, ``scope``,
    ``namespace``, ``limit``)."""
    return list_stored(registry, RECORD_KIND, **filters)
