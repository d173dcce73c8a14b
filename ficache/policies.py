"""Measurement policies, stored once: their ids in the ``policies`` table.

A FlashInfer cache value's third element, the measurement policy, is the same
list for nearly every entry of a file, so the registry stores each distinct
policy once and entries and changes name it by id (``models.PolicyRow``).

Invariants:
- A policy row is canonical JSON text (``flashinfer_format.canonical_json``
  of a list, as every reader of files, bundles and stores makes it) with
  the SHA-256 hex ``digest`` of that text; the digest is unique, so one text
  has one id.
- Rows are only added, inside the caller's write transaction: never changed
  or deleted, so an id held by an entry or a change row stays valid, and a
  revert can write back an old id as it is.
- ``policy_ids`` returns an id for every text it is given, reading those
  that exist and inserting the rest; writers hold the registry's write lock
  (``schema.write_transaction``), so two writers never insert one policy
  at once.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from typing import Any

from sqlalchemy import Connection, select

from ficache.models import POLICIES as P

_CHUNK = 500  # digests per IN (...) list


def policy_digest(policy_json: str) -> str:
    """The ``policies.digest`` of one policy's canonical JSON text."""
    return hashlib.sha256(policy_json.encode("utf-8")).hexdigest()


def policy_ids(conn: Connection, texts: Iterable[str | None]) -> dict[str, int]:
    """``{policy JSON: id}`` for every non-NULL text in ``texts``, inserting
    the policies not stored yet (in sorted order, so ids are reproducible)."""
    wanted = {policy_digest(t): t for t in set(texts) if t is not None}
    found: dict[str, int] = {}
    digests = sorted(wanted)
    for start in range(0, len(digests), _CHUNK):
        chunk = digests[start : start + _CHUNK]
        for pid, digest in conn.execute(select(P.c.id, P.c.digest).where(P.c.digest.in_(chunk))):
            found[wanted[digest]] = int(pid)
    missing = sorted(t for t in wanted.values() if t not in found)
    for text in missing:
        found[text] = _insert(conn, text)
    return found


def _insert(conn: Connection, text: str) -> int:
    result: Any = conn.execute(P.insert().values(digest=policy_digest(text), policy=text))
    key = result.inserted_primary_key
    assert key is not None, "INSERT returned no primary key"
    return int(key[0])


def policy_texts(conn: Connection) -> dict[int, str]:
    """``{id: policy JSON}`` of every stored policy (a registry holds a handful)."""
    return {int(pid): text for pid, text in conn.execute(select(P.c.id, P.c.policy))}


__all__ = ["policy_digest", "policy_ids", "policy_texts"]
