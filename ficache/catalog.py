"""What a registry holds, as the inspection commands list it: fingerprints, filters, scopes.

The registry answers queries; this module decides what a listing shows and
what it should tell about what it did not show.

Invariants:
- Read only: every function here opens one connection and writes nothing.
- A filter on fingerprint fields (``FieldFilters``: exact values, as
  ``list`` and ``fingerprints`` take them) that matches no stored
  fingerprint is reported as a ``FilterMiss`` naming the filter and the
  values that do exist, so an empty answer is never silent. Filters that
  each match some fingerprint but none together are one miss naming them
  all.
- A fingerprint is *empty* when it holds no entries and no records (a prune
  took them all). ``fingerprint_listing`` hides empty ones unless asked and
  counts what it hid.
- Scopes are what entries and records are stored under (``stored_scopes``);
  ``shared`` counts only where something is stored under it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.exc import DatabaseError

from ficache.fingerprint import Fingerprint
from ficache.models import ENTRIES as E
from ficache.models import RECORDS as R
from ficache.models import SHARED_SCOPE
from ficache.registry import FingerprintInfo

#: The fingerprint fields the listings filter on, as ``field -> value`` (None: no filter).
FieldFilters = Mapping[str, str | None]

#: How many existing values a ``FilterMiss`` names before it says "and N more".
MISS_VALUES_SHOWN = 6


@dataclass(frozen=True)
class FingerprintSummary:
    """One stored fingerprint with what it holds."""

    info: FingerprintInfo
    records: int
    #: Where the environment asked about (``fingerprint_listing(here=...)``) is served from:
    #: ``"serves"`` (the first in ``fingerprint.serving_order``: its values win),
    #: ``"fills in"`` (it matches too, and serves only keys the first lacks) or None.
    here: str | None = None

    @property
    def is_empty(self) -> bool:
        return self.info.entries == 0 and self.records == 0

    def as_json(self) -> dict[str, Any]:
        """Every field (a missing one as null), the counts and the times."""
        fp = self.info.fingerprint
        return {
            "id": self.info.id,
            "digest": fp.digest,
            **fp.reported(),
            "entries": self.info.entries,
            "records": self.records,
            "created_at": self.info.created_at,
            "last_served_at": self.info.last_served_at,
            **({"here": self.here} if self.here is not None else {}),
        }


@dataclass(frozen=True)
class FilterMiss:
    """Filters that match no stored fingerprint: one field's, or several together.

    ``filters`` is ``((field, value), ...)``; ``existing`` the values stored
    for a single field (sorted), empty for a combination.
    """

    filters: tuple[tuple[str, str], ...]
    existing: tuple[str, ...] = ()


@dataclass(frozen=True)
class FingerprintListing:
    shown: tuple[FingerprintSummary, ...]
    hidden_empty: int  # empty fingerprints left out (``include_empty=False``)
    misses: tuple[FilterMiss, ...]


def _matches(fp: Fingerprint, filters: FieldFilters) -> bool:
    return all(value is None or getattr(fp, name) == value for name, value in filters.items())


def filter_misses(
    fingerprints: Sequence[Fingerprint], filters: FieldFilters
) -> tuple[FilterMiss, ...]:
    """The filters of ``filters`` that no fingerprint of ``fingerprints`` matches.

    Each given filter that matches none on its own is one miss with the
    values that exist; when each matches some but no fingerprint matches
    them all, the one miss names them all.
    """
    given = [(name, value) for name, value in filters.items() if value is not None]
    misses = tuple(
        FilterMiss(((name, value),), tuple(sorted({getattr(fp, name) for fp in fingerprints})))
        for name, value in given
        if not any(getattr(fp, name) == value for fp in fingerprints)
    )
    if misses or len(given) < 2 or any(_matches(fp, filters) for fp in fingerprints):
        return misses
    return (FilterMiss(tuple(given)),)


def stored_filter_misses(
    registry: Any, filters: FieldFilters, fingerprint_ids: Sequence[int] | None = None
) -> tuple[FilterMiss, ...]:
    """``filter_misses`` among the stored fingerprints (all, or those of ``fingerprint_ids``)."""
    if all(value is None for value in filters.values()):
        return ()
    infos = registry.fingerprints(ids=fingerprint_ids)
    return filter_misses([i.fingerprint for i in infos], filters)


def fingerprint_listing(
    registry: Any,
    *,
    filters: FieldFilters,
    include_empty: bool = False,
    here: Fingerprint | None = None,
) -> FingerprintListing:
    """The stored fingerprints ``fingerprints`` lists: filtered, empty ones hidden unless
    asked; with ``here`` (an environment), each marked by how it serves it
    (``FingerprintSummary.here``)."""
    infos = registry.fingerprints()
    counts = _record_counts(registry)
    marks: dict[int, str] = {}
    if here is not None:
        order = [i.id for i in registry.serving(here) if i.entries or counts.get(i.id)]
        marks = {fid: "serves" if n == 0 else "fills in" for n, fid in enumerate(order)}
    matching = [i for i in infos if _matches(i.fingerprint, filters)]
    summaries = [FingerprintSummary(i, counts.get(i.id, 0), marks.get(i.id)) for i in matching]
    shown = tuple(s for s in summaries if include_empty or not s.is_empty)
    return FingerprintListing(
        shown,
        len(summaries) - len(shown),
        filter_misses([i.fingerprint for i in infos], filters),
    )


def stored_scopes(registry: Any, fingerprint_ids: Sequence[int]) -> tuple[str, ...]:
    """The scopes (sorted) that entries or records of ``fingerprint_ids`` are stored under."""
    ids = list(fingerprint_ids)
    if not ids:
        return ()
    scopes: set[str] = set()
    with _reading(registry) as conn:
        for table in (E, R):
            query = select(table.c.scope).where(table.c.fingerprint_id.in_(ids)).distinct()
            scopes.update(row[0] for row in conn.execute(query))
    return tuple(sorted(scopes))


def _record_counts(registry: Any) -> dict[int, int]:
    with _reading(registry) as conn:
        rows = conn.execute(select(R.c.fingerprint_id, func.count()).group_by(R.c.fingerprint_id))
        return {int(fid): int(n) for fid, n in rows}


@contextlib.contextmanager
def _reading(registry: Any) -> Iterator[Any]:
    """A read connection of ``registry``; database errors become ficache's one-line ones."""
    from ficache import schema

    try:
        with registry.engine.connect() as conn:
            yield conn
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, registry.location) from None


def unstored_scope(
    registry: Any, fingerprint_ids: Sequence[int], scope: str
) -> tuple[str, ...] | None:
    """The scopes stored for ``fingerprint_ids`` when ``scope`` is none of them, else None.

    An export for a rank scope holds the shared entries plus that scope's;
    None says the scope holds something (or is ``shared``), a tuple that
    the export can only be the shared entries, and what the rank scopes are.
    """
    if scope == SHARED_SCOPE:
        return None
    scopes = stored_scopes(registry, fingerprint_ids)
    return None if scope in scopes else tuple(s for s in scopes if s != SHARED_SCOPE)
