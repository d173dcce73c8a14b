"""Import plans: an import's own inputs reconciled under merge's policies, then one commit.

``plan_import(inputs, policy)`` takes the inputs of one ``import`` (FlashInfer
files, bundles, v2 stores: each an ``ImportInput`` of entries and namespaced
records) and decides, for every identity that more than one input holds,
which value is imported. ``ImportPlan.execute(registry, sources)`` writes the
chosen values as one ``import`` commit (``ficache.ingest_commit`` builds its
message and provenance from ``sources``, a description of what was read, and
the plan's conflict counts); ``ImportPlan.preview(registry)`` says what that
commit would do, reading the registry only (``import --dry-run``). An
adoption of vLLM's or SGLang's caches is written as an import plan too
(``adopt.AdoptionPlan.import_plan``).

An import stores what its inputs hold, replacing the registry's values: the
registry is no party to a conflict among the inputs, and a conflict is one
(fingerprint, scope, key) (for records: and namespace) that two input entries
hold with different values (runner, tactic, policy; a record's JSON value).

Invariants:
- One rule with ``merge``, one machinery for every kind: a conflict is
  resolved by ``ficache.kind_merge.resolve`` with no target (``reconcile``,
  over ``merge``'s description of each kind), as a merge resolves the
  sources of a key the registry does not hold (``keep``: the first input's value; ``theirs``: the last's;
  ``newest``: the latest tuned, by ``tuned_time.tuned_at``; ``vote``:
  the value most inputs hold). ``drop`` leaves the identity out of the import
  (an import never removes: the registry's value, if any, stays as it was);
  ``fail`` refuses the whole import (``check``: one line naming a key and its
  inputs) before the registry is written.
- Every input entry is in exactly one count: of an identity's ``n`` input
  entries holding ``d`` distinct values, the one imported is added, replaced
  or unchanged (by the write), ``d - 1`` are ``conflicts`` (all ``d`` when the
  identity is dropped) and ``n - d`` are ``duplicates``. Records likewise.
- The plan is a function of the inputs and the policy only. ``execute``
  writes every chosen value, equal ones too, in one ``Registry.write`` that
  compares them with the stored values under the write lock: an import is
  never applied to a state it was not planned from, so concurrent imports
  all succeed and end as some sequential order of them would.
- Bundles enter here too: ``plan_bundle_import`` makes one input per verified
  bundle (``ficache.bundle`` reads and verifies; it plans no import), and
  ``import_bundles`` executes it with ``bundle_sources``.
- One environment, one fingerprint: a FlashInfer file names only the fields
  FlashInfer records, so its fingerprint has the wildcard for compute
  capability and torch version. Where that fingerprint is not stored but
  exactly one stored fingerprint has the same FlashInfer fields (the file is
  an export of it, say), ``execute`` and ``preview`` land its entries and
  records in that stored one (``landed``), which serves the environment,
  rather than adding a second fingerprint that never would.
- ``preview`` is the counts ``execute`` returns on the same registry state,
  computed as a one-source ``theirs`` merge plan (``ficache.merge``), which
  never writes.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.exc import DatabaseError

from ficache import ingest, schema, tuned_time
from ficache._gcpause import paused_gc
from ficache.bundle import Bundle, bundle_records
from ficache.errors import MergeConflictError
from ficache.fingerprint import WILDCARD, Fingerprint
from ficache.flashinfer_format import CacheFile
from ficache.ingest_commit import ConflictCounts, IngestCommit, IngestSources
from ficache.kind_merge import reconcile
from ficache.kinds import PROTOCOL_KIND
from ficache.merge import (
    ENTRY_MERGE,
    POLICIES,
    PROTOCOL_MERGE,
    RECORD_MERGE,
    MergeConflict,
    MergeSource,
    RecordConflict,
    plan_merge,
)
from ficache.models import SHARED_SCOPE
from ficache.protocol_records import NewProtocolRecord
from ficache.records import NewRecord
from ficache.registry_access import RegistryAccess
from ficache.stored_fingerprints import fingerprint_ids
from ficache.v2_store import (
    StoreContents,
    store_entries,
    store_protocol_records,
    stores_provenance,
)
from ficache.values import NewEntry, WriteResult, validate_scope


@dataclass(frozen=True)
class ImportInput:
    """One input of an import: its name and what it holds.

    Its entries and records carry their ``tuned_at`` (``tuned_time.tuned_at``,
    the rule of every ingest path), which ``newest`` compares and the import
    writes.
    """

    name: str
    entries: tuple[NewEntry, ...] = field(repr=False)
    records: tuple[NewRecord, ...] = field(default=(), repr=False)
    protocol_records: tuple[NewProtocolRecord, ...] = field(default=(), repr=False)


@dataclass(frozen=True)
class ImportPlan:
    """What one import writes: the chosen value of every identity its inputs hold."""

    policy: str
    sources: tuple[str, ...]  # the inputs' names, in order (numbered from 1)
    entries: int  # input entries, duplicates and conflicts included
    records: int  # input records, likewise
    writes: tuple[NewEntry, ...] = field(repr=False)
    record_writes: tuple[NewRecord, ...] = field(repr=False)
    duplicates: int = 0
    conflicts: int = 0
    records_duplicates: int = 0
    records_conflicts: int = 0
    #: Each identity held with different values, and how the policy resolved it
    #: (``fingerprint_id`` and ``target`` are None: the registry is no party).
    conflicting: tuple[MergeConflict, ...] = ()
    conflicting_records: tuple[RecordConflict, ...] = ()
    #: FlashInfer 0.7.4's protocol records, as records are counted and chosen.
    protocol_records: int = 0
    protocol_writes: tuple[NewProtocolRecord, ...] = field(default=(), repr=False)
    protocol_duplicates: int = 0
    protocol_conflicts: int = 0
    conflicting_protocol: tuple[RecordConflict, ...] = ()

    @property
    def refused(self) -> bool:
        """True when the policy is ``fail`` and inputs disagree (any kind)."""
        return self.policy == "fail" and bool(
            self.conflicting or self.conflicting_records or self.conflicting_protocol
        )

    def check(self) -> None:
        """Raise ``MergeConflictError`` (one line naming a key and its inputs) when refused."""
        if not self.refused:
            return
        if self.conflicting:
            first: Any = self.conflicting[0]
            what = f"entry {first.key[:160]!r}"
        elif self.conflicting_records:
            first = self.conflicting_records[0]
            what = f"record {first.namespace}/{first.key[:160]!r}"
        else:
            first = self.conflicting_protocol[0]
            what = f"protocol record {first.namespace}/{first.key[:160]!r}"
        names = list(dict.fromkeys(self.sources[n - 1] for n, _value in first.sources))
        held = " and ".join(names) if len(names) > 1 else f"{names[0]} (twice)"
        others = (
            len(self.conflicting)
            + len(self.conflicting_records)
            + len(self.conflicting_protocol)
            - 1
        )
        more = f" ({others} more conflicting)" if others else ""
        raise MergeConflictError(
            f"{held} hold different values for {what} (fingerprint {first.fingerprint[:12]}, "
            f"scope {first.scope}){more}; nothing imported; choose which wins with "
            "--on-conflict keep|theirs|newest|vote|drop"
        )

    @property
    def counts(self) -> ConflictCounts:
        """What the inputs held more than once (the commit's provenance records them)."""
        return ConflictCounts(
            self.policy,
            self.duplicates,
            self.conflicts,
            self.records_duplicates,
            self.records_conflicts,
            self.protocol_duplicates,
            self.protocol_conflicts,
        )

    def execute(
        self,
        registry: RegistryAccess,
        sources: IngestSources | None = None,
        *,
        message: str = "",
        provenance: dict[str, Any] | None = None,
    ) -> WriteResult:
        """Write the chosen values as one ``import`` commit (none when nothing changes).

        ``sources`` names what was read (``ficache.ingest_commit``); ``message``
        and ``provenance`` are its short form, the sources as one name.
        Raises ``MergeConflictError`` for a refused plan, writing nothing.
        """
        self.check()
        if sources is None:
            sources = IngestSources((message,), provenance=provenance)
        landed = self.landed(registry)
        return IngestCommit.of("import", sources, self.counts).write(
            registry,
            landed.writes,
            records=landed.record_writes,
            protocol_records=landed.protocol_writes,
        )

    def landed(self, registry: RegistryAccess) -> ImportPlan:
        """This plan with each fingerprint a FlashInfer file names (compute capability and
        torch version the wildcard) that ``registry`` does not hold, but holds exactly one
        stored fingerprint with the same FlashInfer fields of, replaced by that stored one."""
        moves = landing(registry, self.fingerprints)
        if not moves:
            return self

        def move(fp: Fingerprint) -> Fingerprint:
            return moves.get(fp, fp)

        return dataclasses.replace(
            self,
            writes=tuple(w._replace(fingerprint=move(w.fingerprint)) for w in self.writes),
            record_writes=tuple(
                dataclasses.replace(r, fingerprint=move(r.fingerprint)) for r in self.record_writes
            ),
            protocol_writes=tuple(
                dataclasses.replace(p, fingerprint=move(p.fingerprint))
                for p in self.protocol_writes
            ),
        )

    @property
    def fingerprints(self) -> set[Fingerprint]:
        """Every fingerprint the plan writes under."""
        found = {w.fingerprint for w in self.writes}
        found.update(r.fingerprint for r in self.record_writes)
        found.update(p.fingerprint for p in self.protocol_writes)
        return found

    def preview(self, registry: RegistryAccess | None) -> WriteResult:
        """The counts ``execute`` would return on ``registry``'s current state; writes nothing.

        ``registry`` None: a registry that does not exist yet (everything is added).
        """
        self.check()
        if registry is None:
            return WriteResult(
                None,
                added=len(self.writes),
                records_added=len(self.record_writes),
                protocol_added=len(self.protocol_writes),
            )
        landed = self.landed(registry)
        source = MergeSource(
            "import", "flashinfer", "", landed.writes, landed.record_writes, landed.protocol_writes
        )
        plan = plan_merge(registry, [source], "theirs")
        # What ``Registry.write`` leaves out of an older schema, counted and said alike.
        holds = registry.features.has_table(PROTOCOL_KIND.rows.name)
        skipped = None
        if self.protocol_writes and not holds:
            what = f"{len(self.protocol_writes)} {PROTOCOL_KIND.plural}"
            skipped = registry.features.skipped(what, registry.location)
        protocol = plan.protocol if holds else None
        return WriteResult(
            None,
            added=plan.added,
            replaced=plan.replaced,
            unchanged=plan.identical,
            records_added=plan.records.added,
            records_replaced=plan.records.replaced,
            records_unchanged=plan.records.identical,
            protocol_added=protocol.added if protocol else 0,
            protocol_replaced=protocol.replaced if protocol else 0,
            protocol_unchanged=protocol.identical if protocol else 0,
            skipped=skipped,
        )


def landing(
    registry: RegistryAccess, fingerprints: Iterable[Fingerprint]
) -> dict[Fingerprint, Fingerprint]:
    """``{fingerprint: the stored one it lands in}`` of those of ``fingerprints`` that a
    FlashInfer file names (compute capability and torch version the wildcard), are not
    stored, and share their FlashInfer fields and measurement policy with exactly one stored
    fingerprint."""
    wanted = [
        fp
        for fp in fingerprints
        if fp.compute_capability == WILDCARD and fp.torch_version == WILDCARD
    ]
    if not wanted:
        return {}
    try:
        with registry.engine.connect() as conn:
            stored = [fp for _id, fp in fingerprint_ids(conn)]
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, registry.location) from None
    held = set(stored)
    # A fingerprint under a measurement policy lands only in one under the same policy:
    # landed in the default's, its entries would replace the default policy's.
    by_fields: dict[tuple[tuple[str, ...], str], list[Fingerprint]] = {}
    for fp in stored:
        by_fields.setdefault((fp.flashinfer_fields, fp.measurement), []).append(fp)
    moves = {}
    for fp in wanted:
        same = by_fields.get((fp.flashinfer_fields, fp.measurement), [])
        if fp not in held and len(same) == 1:
            moves[fp] = same[0]
    return moves


def plan_import(inputs: Sequence[ImportInput], policy: str = "keep") -> ImportPlan:
    """Plan importing ``inputs`` (in this order) under ``policy`` (``ficache.merge.POLICIES``)."""
    if policy not in POLICIES:
        raise ValueError(
            f"unknown conflict policy {policy!r}; expected one of {', '.join(POLICIES)}"
        )
    with paused_gc():
        entries = reconcile(ENTRY_MERGE, [i.entries for i in inputs], policy)
        records = reconcile(RECORD_MERGE, [i.records for i in inputs], policy)
        protocol = reconcile(PROTOCOL_MERGE, [i.protocol_records for i in inputs], policy)
    return ImportPlan(
        policy,
        tuple(i.name for i in inputs),
        sum(len(i.entries) for i in inputs),
        sum(len(i.records) for i in inputs),
        tuple(entries.writes),
        tuple(records.writes),
        entries.duplicates,
        entries.conflicts,
        records.duplicates,
        records.conflicts,
        tuple(entries.conflicting),
        tuple(records.conflicting),
        sum(len(i.protocol_records) for i in inputs),
        tuple(protocol.writes),
        protocol.duplicates,
        protocol.conflicts,
        tuple(protocol.conflicting),
    )


def file_inputs(
    files: Sequence[tuple[str, CacheFile]],
    *,
    fingerprint: Fingerprint | None = None,
    scope: str = SHARED_SCOPE,
    paths: Sequence[str | os.PathLike[str] | None] | None = None,
) -> list[ImportInput]:
    """The ``ImportInput`` of each parsed FlashInfer file, in order.

    A file's own ``_metadata`` names its fingerprint; ``fingerprint`` is used
    only for files that have none (``FingerprintError`` for such a file
    without it: ``ingest.file_fingerprint``). ``paths``: the file each was
    read from, whose mtime dates its entries and records (``ingest.file_results``,
    which a merge's files go through too; without one, now).
    """
    validate_scope(scope)
    inputs = []
    for number, (source, cache) in enumerate(files):
        read = ingest.file_results(
            cache,
            ingest.file_fingerprint(source, cache, fingerprint),
            scope=scope,
            path=paths[number] if paths is not None else None,
        )
        inputs.append(ImportInput(source, read.entries, read.records))
    return inputs


# --------------------------------------------------------------------------
# Bundles (``ficache.bundle`` reads and verifies them; here they become one import).


def plan_bundle_import(bundles: Sequence[tuple[str, Bundle]], policy: str = "keep") -> ImportPlan:
    """The import plan of verified ``(source, bundle)`` pairs (one input per bundle).

    Entries keep their scope, ``tuned_at`` and selection, records their scope;
    records carry no tuning time, so the bundle file's mtime dates them
    (``tuned_time.tuned_at``, as ``merge`` dates them). A key two bundles hold
    with different values is resolved by ``policy``, as ``merge`` does.
    """
    return plan_import(
        [
            ImportInput(
                source,
                tuple(b.entries),
                tuple(bundle_records(b, tuned_time.tuned_at(None, source))),
                b.protocol_records,
            )
            for source, b in bundles
        ],
        policy,
    )


def bundles_provenance(bundles: Sequence[tuple[str, Bundle]]) -> dict[str, Any]:
    """An import commit's provenance: every bundle by digest (``protocol_records`` only for
    a bundle that holds some)."""
    return {
        "bundles": [
            {
                "digest": b.digest,
                "format_version": b.format_version,
                "entries": len(b.entries),
                "records": int(b.provenance["records"]),
                **({"protocol_records": len(b.protocol_records)} if b.protocol_records else {}),
            }
            for _source, b in bundles
        ]
    }


def bundle_sources(bundles: Sequence[tuple[str, Bundle]]) -> IngestSources:
    """What an import of ``bundles`` names: each bundle's path, and each by digest."""
    return IngestSources(
        tuple(source for source, _ in bundles), provenance=bundles_provenance(bundles)
    )


def import_bundles(
    registry: RegistryAccess, bundles: Sequence[tuple[str, Bundle]], *, on_conflict: str = "keep"
) -> WriteResult:
    """Store the entries of verified ``(source, bundle)`` pairs as one import commit.

    The commit's provenance names every bundle by digest. Importing the same
    bundles again changes nothing and makes no commit.
    """
    return plan_bundle_import(bundles, on_conflict).execute(registry, bundle_sources(bundles))


def plan_store_import(
    stores: Sequence[StoreContents], *, scope: str = SHARED_SCOPE, policy: str = "keep"
) -> ImportPlan:
    """The import plan of v2 ``stores`` (one input per store, ``v2_store.store_entries``;
    their protocol records stored shared, ``v2_store.store_protocol_records``).

    A key two stores hold with different values is resolved by ``policy``,
    as ``merge`` does. Environments that differ only in their measurement policy are
    different fingerprints (``Fingerprint.measurement``): stored apart, in one commit.
    """
    return plan_import(
        [
            ImportInput(
                str(store.source),
                store_entries(store, scope),
                protocol_records=store_protocol_records(store),
            )
            for store in stores
        ],
        policy,
    )


def store_sources(stores: Sequence[StoreContents]) -> IngestSources:
    """What an import of v2 ``stores`` names: each store's path, and every environment
    read (``v2_store.stores_provenance``)."""
    return IngestSources(tuple(str(s.source) for s in stores), provenance=stores_provenance(stores))


def import_stores(
    registry: RegistryAccess,
    stores: Sequence[StoreContents],
    *,
    scope: str = SHARED_SCOPE,
    on_conflict: str = "keep",
) -> WriteResult:
    """Import every environment of ``stores`` as one commit (``v2_store.stores_provenance``)."""
    plan = plan_store_import(stores, scope=scope, policy=on_conflict)
    return plan.execute(registry, store_sources(stores))


__all__ = [
    "ImportInput",
    "ImportPlan",
    "bundle_sources",
    "bundles_provenance",
    "file_inputs",
    "import_bundles",
    "import_stores",
    "plan_bundle_import",
    "plan_import",
    "plan_store_import",
    "store_sources",
]
