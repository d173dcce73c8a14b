"""Folding one stored fingerprint into another: a frozen plan, then one commit.

Two stored fingerprints can describe one environment: a FlashInfer file
re-imported before the import landed in the fingerprint it was exported from
(its compute capability and torch version the wildcard), say. Only one of
them serves it (``fingerprint.serving_order``). ``plan_fold(registry,
source, into)`` plans moving every entry, record and protocol record of
``source`` to ``into`` (same scope and key) and returns a ``FoldPlan``: the
counts per kind and the exact write. ``FoldPlan.execute`` applies it as one
``merge`` commit, which ``ficache revert`` undoes like any other.

Invariants:
- Only fingerprints that could describe one environment fold: each field is
  equal or the wildcard on one side (``FoldError`` otherwise, nothing read
  further); a fingerprint never folds into itself.
- Where ``into`` holds another value for a moved identity, the source's
  value replaces it, unless the plan keeps the target's (``keep_target``);
  either way the source's row is removed, recorded with its value, so a
  revert restores it.
- ``execute`` writes nothing unless every identity the plan touches (both
  fingerprints') is still held by the commit that held it when planned
  (``Registry.write``'s ``expected``); otherwise ``ConflictError``.
- Written once over the kinds (``ficache.kinds``); it names no kind's columns.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Connection, select
from sqlalchemy.exc import DatabaseError

from ficache import schema
from ficache.errors import ConflictError, FicacheError
from ficache.fingerprint import ALL_FIELDS, WILDCARD
from ficache.kind_read import stored_items
from ficache.kinds import ENTRY_KIND, KINDS, PROTOCOL_KIND, RECORD_KIND, Kind, kind_named
from ficache.protocol_records import ProtocolWrite
from ficache.records import RecordWrite
from ficache.registry_access import RegistryAccess
from ficache.stored_fingerprints import FingerprintInfo, fingerprint
from ficache.values import WriteResult

__all__ = ["FoldCounts", "FoldError", "FoldPlan", "plan_fold"]


class FoldError(FicacheError):
    """Two fingerprints that cannot be folded (no environment is described by both)."""


@dataclass(frozen=True)
class FoldCounts:
    """What folding does to one kind: ``moved`` (the target lacked it), ``replaced`` (the
    target held another value, now the source's), ``kept`` (the target's value kept),
    ``same`` (both held one value)."""

    kind: str
    moved: int = 0
    replaced: int = 0
    kept: int = 0
    same: int = 0

    @property
    def total(self) -> int:
        return self.moved + self.replaced + self.kept + self.same

    def as_json(self) -> dict[str, int]:
        return {
            "moved": self.moved,
            "replaced": self.replaced,
            "kept": self.kept,
            "same": self.same,
        }


@dataclass(frozen=True)
class _KindWrite:
    """One kind's part of the fold's write (as ``Registry.write`` takes it)."""

    counts: FoldCounts
    writes: tuple[Any, ...] = field(default=(), repr=False)
    removals: tuple[tuple[Any, ...], ...] = field(default=(), repr=False)
    expected: tuple[tuple[tuple[Any, ...], int | None], ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class FoldPlan:
    """Folding ``source`` into ``into`` on the registry ``target``; compare with ``==``."""

    target: str  # the registry planned on (``Location.display``)
    source: FingerprintInfo
    into: FingerprintInfo
    keep_target: bool
    parts: tuple[_KindWrite, ...] = field(repr=False)

    @property
    def counts(self) -> tuple[FoldCounts, ...]:
        """Per kind, in ``KINDS`` order."""
        return tuple(p.counts for p in self.parts)

    @property
    def is_empty(self) -> bool:
        """True when ``source`` holds nothing to fold."""
        return not any(c.total for c in self.counts)

    def as_json(self) -> dict[str, Any]:
        return {
            "target": self.target,
            "source": self.source.id,
            "into": self.into.id,
            "keep_target": self.keep_target,
            **{kind_named(c.kind).plural.replace(" ", "_"): c.as_json() for c in self.counts},
        }

    def execute(self, registry: RegistryAccess) -> WriteResult:
        """Apply the plan as one ``merge`` commit (none when ``is_empty``).

        Raises ``ConflictError``, writing nothing, when anything the plan
        touches changed since it was made.
        """
        registry.require_planned_on(self.target)
        entries, records, protocol = self.parts
        src, dst = self.source, self.into
        try:
            return registry.write(
                entries.writes,
                kind="merge",
                message=f"fold fingerprint {src.id} into {dst.id}",
                provenance={
                    "fold": {"from": src.fingerprint.digest, "into": dst.fingerprint.digest},
                    "keep_target": self.keep_target,
                },
                removals=entries.removals,
                expected=entries.expected,
                keep_existing=self.keep_target,
                records=RecordWrite(records.writes, records.removals, records.expected),
                protocol_records=ProtocolWrite(
                    protocol.writes, protocol.removals, protocol.expected
                ),
            )
        except ConflictError:
            raise ConflictError(
                f"registry {self.target} changed since the fold was planned; nothing changed, "
                f"plan it again (ficache fold {src.id} --into {dst.id})"
            ) from None


def plan_fold(
    registry: RegistryAccess, source: int | str, into: int | str, *, keep_target: bool = False
) -> FoldPlan:
    """Plan folding the stored fingerprint ``source`` into ``into`` (ids or digest prefixes).

    Raises ``NotFoundError`` for an unknown one, ``FoldError`` for two that
    cannot describe one environment.
    """
    try:
        with registry.engine.connect() as conn:
            src, dst = fingerprint(conn, source), fingerprint(conn, into)
            _check_foldable(src, dst)
            parts = tuple(_fold_kind(conn, kind, src, dst, keep_target) for kind in KINDS)
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, registry.location) from None
    assert tuple(KINDS) == (ENTRY_KIND, RECORD_KIND, PROTOCOL_KIND)
    return FoldPlan(registry.location.display, src, dst, keep_target, parts)


def _check_foldable(src: FingerprintInfo, dst: FingerprintInfo) -> None:
    if src.id == dst.id:
        raise FoldError(f"fingerprint {src.id} cannot fold into itself; name another")
    differ = [
        name
        for name in ALL_FIELDS
        if WILDCARD
        not in (a := getattr(src.fingerprint, name), b := getattr(dst.fingerprint, name))
        and a != b
    ]
    if differ:
        name = differ[0]
        raise FoldError(
            f"fingerprints {src.id} and {dst.id} differ in {name} "
            f"({getattr(src.fingerprint, name)!r} vs {getattr(dst.fingerprint, name)!r}), so no "
            "environment is described by both; fold only fingerprints of one environment"
        )


def _fold_kind(
    conn: Connection, kind: Kind, src: FingerprintInfo, dst: FingerprintInfo, keep_target: bool
) -> _KindWrite:
    """One kind's items of ``src`` written under ``dst``, ``src``'s rows removed."""
    fps = {src.id: src.fingerprint, dst.id: dst.fingerprint}
    moving = stored_items(conn, kind, fps, [src.id])
    held = {
        tuple(kind.item_identity_of(item)[1:]): kind.item_value_of(item)
        for item in stored_items(conn, kind, fps, [dst.id])
    }
    holders = _holders(conn, kind, (src.id, dst.id))
    writes, removals, expected = [], [], []
    moved = replaced = kept = same = 0
    for item in moving:
        _fp, scope, *ident = kind.item_identity_of(item)
        rest = (scope, *ident)
        value = kind.item_value_of(item)
        writes.append(
            kind.make_item(dst.fingerprint, scope, tuple(ident), value, kind.item_carried_of(item))
        )
        removals.append((src.fingerprint, *rest))
        expected.append(((src.fingerprint, *rest), holders.get((src.id, *rest))))
        expected.append(((dst.fingerprint, *rest), holders.get((dst.id, *rest))))
        there = held.get(rest)
        if there is None:
            moved += 1
        elif kind.same_value(there, value):
            same += 1
        elif keep_target:
            kept += 1
        else:
            replaced += 1
    counts = FoldCounts(kind.name, moved, replaced, kept, same)
    return _KindWrite(counts, tuple(writes), tuple(removals), tuple(expected))


def _holders(conn: Connection, kind: Kind, ids: Iterable[int]) -> dict[tuple[Any, ...], int]:
    """``(fingerprint id, scope, *identity) -> commit`` of the kind's rows of ``ids``."""
    rows = kind.rows
    columns = [rows.c[name] for name in kind.identity_columns]
    query = select(*columns, rows.c.commit_id).where(rows.c.fingerprint_id.in_(list(ids)))
    return {tuple(row[:-1]): int(row[-1]) for row in conn.execute(query)}
