"""Prune: plans that remove the stored rows matching some criteria, and their execution.

This module owns prune's decisions, for every stored kind alike
(``kinds.STORED_KINDS``: entries, namespaced records, protocol records):
- the criteria (``prune_conditions``): each a condition on a kind's table
  joined with its fingerprint, and the ``(name, value)`` pairs a plan shows;
- planning (``plan_prune``): the rows each criterion set matches, read on one
  connection, grouped by fingerprint and scope (``PruneGroup``) into a frozen
  ``PrunePlan`` that compares with ``==``;
- execution (``PrunePlan.execute``): the planned rows removed in one
  ``prune`` commit, whose change rows let ``revert`` restore them.

It does not own the SQL over a kind's tables (``kind_store.prune_candidates``,
``kind_store.stage_planned_removals``, ``kind_store.apply``), the write
transaction, its lock and retries (``Registry.transaction``), or how a plan is
shown (the CLI). It never imports ``ficache.registry``: it takes the registry
typed as ``PruneTarget``, which ``Registry`` satisfies (``Registry.plan_prune``
delegates here), so there is no import cycle.

Invariants:
- A plan holds ``(row id, commit id)`` of every row it removes, of the
  registry it was made on (``target``); ``execute`` refuses any other
  registry (``require_planned_on``).
- Execution removes exactly the planned rows, or nothing: under the write
  lock each planned row must still hold the commit it was planned at, else
  ``ConflictError`` and the transaction rolls back ("run prune again").
- Planning only reads; a plan of nothing executes as no commit.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol, TypeVar

from sqlalchemy import Connection, Engine, func
from sqlalchemy.exc import DatabaseError

from ficache import kind_store, schema
from ficache.errors import ConflictError, FicacheError
from ficache.kinds import ENTRY_KIND, PROTOCOL_KIND, RECORD_KIND, STORED_KINDS, Kind
from ficache.location import Location
from ficache.models import FINGERPRINTS as F
from ficache.stored_fingerprints import FingerprintInfo
from ficache.values import WriteResult, validate_scope

T = TypeVar("T")

#: ``PruneGroup``'s count field of each stored kind.
_GROUP_COUNT_FIELD = {
    ENTRY_KIND.name: "entries",
    RECORD_KIND.name: "records",
    PROTOCOL_KIND.name: "protocol_records",
}
#: ``PrunePlan``'s ``(row id, commit id)`` field of each stored kind.
_VERSIONS_FIELD = {
    ENTRY_KIND.name: "entry_versions",
    RECORD_KIND.name: "record_versions",
    PROTOCOL_KIND.name: "protocol_versions",
}


class PruneTarget(Protocol):
    """What a prune needs of a ``Registry`` (``ficache.registry.Registry`` satisfies it)."""

    location: Location
    engine: Engine

    def fingerprint(self, ref: int | str) -> FingerprintInfo:
        """A stored fingerprint by id or digest prefix (``Registry.fingerprint``)."""
        ...

    def require_planned_on(self, target: str) -> None:
        """Raise ``ValueError`` unless ``target`` names this registry (``Registry.require_planned_on``)."""
        ...

    def transaction(self, body: Callable[[Connection], T]) -> T:
        """``body(conn)`` in one write transaction (``Registry.transaction``)."""
        ...


@dataclass(frozen=True)
class PruneGroup:
    fingerprint_id: int
    gpu: str
    flashinfer_version: str
    scope: str
    entries: int
    records: int = 0  # namespaced records (``ficache.records``) of the group
    protocol_records: int = 0  # FlashInfer 0.7.4's protocol records of the group


@dataclass(frozen=True)
class PrunePlan:
    """What a prune would remove; compare plans with ``==``, run ``execute``.

    ``total`` counts entries, ``records_total`` namespaced records: a prune
    removes the records that match its criteria with the entries (see
    ``plan_prune``). ``execute`` refuses a registry other than ``target``,
    the one it was planned on.
    """

    target: str  # the registry planned on (``Location.display``)
    criteria: tuple[tuple[str, str], ...]
    groups: tuple[PruneGroup, ...]
    entry_versions: tuple[tuple[int, int], ...] = field(repr=False)  # (entry id, commit id)
    #: (record id, commit id) of the records it removes.
    record_versions: tuple[tuple[int, int], ...] = field(default=(), repr=False)
    #: (protocol record id, commit id) of the protocol records it removes.
    protocol_versions: tuple[tuple[int, int], ...] = field(default=(), repr=False)

    @property
    def total(self) -> int:
        return len(self.entry_versions)

    @property
    def records_total(self) -> int:
        return len(self.record_versions)

    @property
    def protocol_total(self) -> int:
        return len(self.protocol_versions)

    @property
    def is_empty(self) -> bool:
        return not self.entry_versions and not self.record_versions and not self.protocol_versions

    def versions(self, kind: Kind) -> tuple[tuple[int, int], ...]:
        """``(row id, commit id)`` of the rows of ``kind`` the plan removes."""
        versions: tuple[tuple[int, int], ...] = getattr(self, _VERSIONS_FIELD[kind.name])
        return versions

    def execute(self, registry: PruneTarget) -> WriteResult:
        """Remove the planned rows as one ``prune`` commit (none when the plan is empty).

        Raises ``ValueError`` for a registry the plan was not made on, and
        ``ConflictError`` (removing nothing) when a planned row changed or
        went since the plan was made.
        """
        registry.require_planned_on(self.target)
        if self.is_empty:
            return WriteResult(None)
        return registry.transaction(partial(_remove_planned, self))


def prune_conditions(
    fingerprint_ids: Sequence[int],
    flashinfer_versions: Sequence[str],
    older_than_seconds: float | None,
    scope: str | None,
    unused_for_seconds: float | None,
    now: float,
) -> tuple[list[Callable[[Any], Any]], list[tuple[str, str]]]:
    """``plan_prune``'s criteria as conditions on a kind's table (joined with its
    fingerprint), and as the ``(name, value)`` pairs the plan shows."""
    criteria: list[tuple[str, str]] = []
    # Each criterion as a condition on a table of rows with fingerprint_id,
    # scope and updated_at (entries, records), joined with its fingerprint.
    conditions: list[Callable[[Any], Any]] = []
    if fingerprint_ids:
        ids = list(fingerprint_ids)
        conditions.append(lambda t: t.c.fingerprint_id.in_(ids))
        criteria.append(("fingerprint", ",".join(map(str, sorted(fingerprint_ids)))))
    if flashinfer_versions:
        versions_in = F.c.flashinfer_version.in_(list(flashinfer_versions))
        conditions.append(lambda t: versions_in)
        criteria.append(("flashinfer_version", ",".join(sorted(flashinfer_versions))))
    if older_than_seconds is not None:
        written_before = now - older_than_seconds
        conditions.append(lambda t: t.c.updated_at < written_before)
        criteria.append(("older_than_seconds", f"{older_than_seconds:g}"))
    if scope is not None:
        wanted_scope = validate_scope(scope)
        conditions.append(lambda t: t.c.scope == wanted_scope)
        criteria.append(("scope", scope))
    if unused_for_seconds is not None:
        used_before = now - unused_for_seconds
        unused = func.coalesce(F.c.last_served_at, F.c.created_at) < used_before
        conditions.append(lambda t: unused)
        shown = (
            f"{unused_for_seconds:.0f}"
            if float(unused_for_seconds).is_integer()
            else f"{unused_for_seconds:g}"
        )
        criteria.append(("unused_for_seconds", shown))
    return conditions, criteria


def plan_prune(
    registry: PruneTarget,
    *,
    fingerprint_ids: Sequence[int] = (),
    flashinfer_versions: Sequence[str] = (),
    older_than_seconds: float | None = None,
    scope: str | None = None,
    unused_for_seconds: float | None = None,
    now: float | None = None,
) -> PrunePlan:
    """Plan removing the rows of every stored kind matching all the given criteria (at least one).

    ``unused_for_seconds``: rows of fingerprints no warm start has served for
    that long: last served before ``now - unused_for_seconds``, or, never
    served, created before it (``ficache.usage``). An unknown fingerprint id
    is ``NotFoundError``; no criterion at all is ``FicacheError``.
    """
    if (
        not fingerprint_ids
        and not flashinfer_versions
        and older_than_seconds is None
        and scope is None
        and unused_for_seconds is None
    ):
        raise FicacheError(
            "prune needs a criterion: --fingerprint, --flashinfer-version, --older-than, "
            "--unused-for or --scope"
        )
    for fid in fingerprint_ids:
        registry.fingerprint(fid)  # raises NotFoundError for an unknown id
    conditions, criteria = prune_conditions(
        fingerprint_ids,
        flashinfer_versions,
        older_than_seconds,
        scope,
        unused_for_seconds,
        time.time() if now is None else now,
    )
    try:
        with registry.engine.connect() as conn:
            return _read_plan(conn, registry.location.display, conditions, criteria)
    except DatabaseError as exc:
        raise schema.translate_operational_error(
            exc, registry.location, engine=registry.engine
        ) from None


@dataclass
class _GroupCounts:
    """One ``(fingerprint, scope)`` group of a plan being read: its fingerprint's GPU and
    FlashInfer version, and the rows of each kind it removes."""

    gpu: str
    flashinfer_version: str
    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(_GROUP_COUNT_FIELD, 0))


def _read_plan(
    conn: Connection,
    target: str,
    conditions: Sequence[Callable[[Any], Any]],
    criteria: Sequence[tuple[str, str]],
) -> PrunePlan:
    """The plan of the rows of every stored kind matching every condition, on one connection."""
    groups: dict[tuple[int, str], _GroupCounts] = {}
    versions: dict[str, list[tuple[int, int]]] = {kind.name: [] for kind in STORED_KINDS}
    for kind in STORED_KINDS:
        for row_id, cid, fid, scope, gpu, fiver in kind_store.prune_candidates(
            conn, kind, conditions
        ):
            versions[kind.name].append((row_id, cid))
            group = groups.setdefault((fid, scope), _GroupCounts(gpu, fiver))
            group.counts[kind.name] += 1
    return PrunePlan(
        target,
        tuple(criteria),
        tuple(
            PruneGroup(
                fingerprint_id=fid,
                gpu=group.gpu,
                flashinfer_version=group.flashinfer_version,
                scope=scope,
                **{_GROUP_COUNT_FIELD[name]: n for name, n in group.counts.items()},
            )
            for (fid, scope), group in sorted(groups.items())
        ),
        **{_VERSIONS_FIELD[name]: tuple(found) for name, found in versions.items()},
    )


def _remove_planned(plan: PrunePlan, conn: Connection) -> WriteResult:
    """Under the write lock: every planned row still as planned, removed in one ``prune``
    commit; ``ConflictError`` (the transaction rolls back) when any is not."""
    staged = []
    for kind in STORED_KINDS:
        versions = plan.versions(kind)
        found = kind_store.stage_planned_removals(conn, kind, versions)
        if len(found.removed) != len(versions):
            raise ConflictError(
                f"{len(versions) - len(found.removed)} of {len(versions)} planned "
                f"{kind.plural} changed since the plan was made; nothing removed, "
                "run prune again"
            )
        staged.append(found)
    now = time.time()
    commit_id = kind_store.new_commit(
        conn,
        now,
        "prune",
        staged,
        message="; ".join(f"{k}={v}" for k, v in plan.criteria),
    )
    for s in staged:
        kind_store.apply(conn, s, commit_id, now)
    counts = kind_store.result_counts(staged)
    return WriteResult(
        commit_id,
        **{k.result_field("removed"): counts[k.result_field("removed")] for k in STORED_KINDS},
    )


__all__ = ["PruneGroup", "PrunePlan", "PruneTarget", "plan_prune", "prune_conditions"]
