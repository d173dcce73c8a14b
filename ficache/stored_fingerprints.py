"""Stored fingerprints, read: which environments a registry holds entries for
(``Registry.fingerprints``, ``fingerprint``, ``serving``).

This module owns reading ``fingerprints`` rows: each as a ``FingerprintInfo``
with its entry count, finding one by id or digest prefix, and the stored
fingerprints an environment may be served from. It does not own creating
fingerprint rows (the registry's write machinery), marking them served
(``ficache.usage``), connections or error translation: every function takes
an open ``Connection`` from ``Registry``.

Invariants:
- Read-only: nothing here writes.
- Entry counts use the entries index per fingerprint, so asking for a few
  fingerprints of a large registry stays cheap.
- A reference is an id (a number no larger than ``MAX_ROW_ID``) or a prefix
  of at least 6 characters of exactly one digest; anything else is
  ``NotFoundError`` (or ``FingerprintError`` for an ambiguous prefix), one
  line saying what to run next.
- ``serving`` lists them in ``fingerprint.serving_order``: exact fields over
  wildcards (fewer ``*`` first), then the newest. The first serves the
  environment: a key it holds is loaded from it; the others fill in only
  keys it lacks (``Registry.slice_rows``: earlier fingerprints win).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, func, select

from ficache import schema
from ficache.errors import FingerprintError, NotFoundError
from ficache.fingerprint import Fingerprint, serving_order
from ficache.models import ENTRIES as E
from ficache.models import FINGERPRINTS as F
from ficache.values import fingerprint_from_row

#: The largest row id SQLite stores (a signed 64-bit integer).
MAX_ROW_ID = 2**63 - 1


@dataclass(frozen=True)
class FingerprintInfo:
    id: int
    fingerprint: Fingerprint
    entries: int
    created_at: float
    last_served_at: float | None = None  # when a warm start last served it; None: never

    def as_json(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "digest": self.fingerprint.digest,
            **self.fingerprint.reported(),  # a missing field as null
            "entries": self.entries,
            "created_at": self.created_at,
            "last_served_at": self.last_served_at,
        }


def fingerprints(conn: Connection, ids: Sequence[int] | None = None) -> list[FingerprintInfo]:
    """Stored fingerprints (all, or those with ``ids``) with their entry counts, by id."""
    fp_query = select(*schema.features(conn).columns(F)).order_by(F.c.id)
    count_query = select(E.c.fingerprint_id, func.count()).group_by(E.c.fingerprint_id)
    if ids is not None:
        fp_query = fp_query.where(F.c.id.in_(list(ids)))
        count_query = count_query.where(E.c.fingerprint_id.in_(list(ids)))
    counts: dict[int, int] = {int(fid): int(n) for fid, n in conn.execute(count_query)}
    return [
        FingerprintInfo(
            row.id,
            fingerprint_from_row(row),
            counts.get(row.id, 0),
            row.created_at,
            row.last_served_at,
        )
        for row in conn.execute(fp_query)
    ]


def fingerprint_ids(conn: Connection) -> list[tuple[int, Fingerprint]]:
    """``(id, fingerprint)`` of every stored fingerprint."""
    query = select(*schema.features(conn).columns(F))
    return [(row.id, fingerprint_from_row(row)) for row in conn.execute(query)]


def fingerprint(conn: Connection, ref: int | str) -> FingerprintInfo:
    """The stored fingerprint ``ref`` names: its id, or a prefix of at least 6 of its digest."""
    text = str(ref).strip()
    if text.isascii() and text.isdigit():
        # Past the largest id a database stores ("²" is a digit int() refuses): not found.
        found = fingerprints(conn, [int(text)]) if int(text) <= MAX_ROW_ID else []
        if found:
            return found[0]
    elif len(text) >= 6:
        matches = [fid for fid, fp in fingerprint_ids(conn) if fp.digest.startswith(text.lower())]
        if len(matches) == 1:
            return fingerprints(conn, matches)[0]
        if len(matches) > 1:
            raise FingerprintError(
                f"fingerprint prefix {text!r} is ambiguous; give more characters or the id"
            )
    raise NotFoundError(f"no fingerprint {text!r} in the registry; see `ficache fingerprints`")


def serving(conn: Connection, current: Fingerprint) -> list[FingerprintInfo]:
    """Stored fingerprints whose entries ``current`` may use, the one that serves it first
    (``fingerprint.serving_order``)."""
    ids = [fid for fid, fp in fingerprint_ids(conn) if fp.serves(current)]
    infos = fingerprints(conn, ids) if ids else []
    infos.sort(key=lambda i: serving_order(i.id, i.fingerprint))
    return infos
