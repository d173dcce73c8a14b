"""The commit every ingest path makes, built from a description of what it read.

Owns ``IngestCommit``: the kind, message and provenance of the one commit an
``import`` (FlashInfer files, bundles, v2 stores: ``importing.ImportPlan``),
an adoption of vLLM's or SGLang's caches (``adopt.AdoptionPlan``, which is
written as an ``ImportPlan``) and a ``merge`` (``merge.MergePlan``) make, and
its one ``write``. Each path describes its sources as data
(``IngestSources``: the heading of its message, the sources' names, what
its provenance records of them) and, for an import, what its inputs held
twice (``ConflictCounts``); none builds a message or a provenance itself.

It does not own what is written (the plans decide), reading or recognising
sources (``ingest`` and the format modules), or the write's transaction
(``Registry.write``).

Invariants:
- The message is the heading, then the sources' names joined by ", ", cut
  to ``MAX_MESSAGE`` characters.
- The provenance is what ``IngestSources`` records of the sources, then the
  conflict counts: ``on_conflict`` and each group of counts holding a
  non-zero one (entries' and records' counts together, protocol records'
  apart, so an import that holds none records what it did before they were
  stored); nothing when every count is zero. An empty provenance is none.
- One ingest is one ``Registry.write`` (one transaction, one commit, none
  when nothing changes), made with the garbage collector paused.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ficache._gcpause import paused_gc
from ficache.fingerprint import Fingerprint
from ficache.protocol_records import NewProtocolRecord, ProtocolWrite
from ficache.records import NewRecord, RecordWrite
from ficache.registry_access import RegistryAccess
from ficache.values import Expected, NewEntry, WriteResult

#: The longest commit message an ingest records.
MAX_MESSAGE = 2000


@dataclass(frozen=True)
class IngestSources:
    """What one ingest read, as its commit names it.

    ``names``: the sources, in order (file paths, registries, roots);
    ``heading``: what the message says before them (``"merge (keep): "``,
    ``"adopted from vLLM: "``; an import says nothing); ``provenance``: what
    the commit records of them (bundles by digest, v2 environments, ...).
    """

    names: tuple[str, ...]
    heading: str = ""
    provenance: Mapping[str, Any] | None = field(default=None, repr=False)

    @property
    def message(self) -> str:
        return f"{self.heading}{', '.join(self.names)}"[:MAX_MESSAGE]


@dataclass(frozen=True)
class ConflictCounts:
    """What an import's inputs held more than once, and the policy that chose among them."""

    policy: str
    duplicates: int = 0
    conflicts: int = 0
    records_duplicates: int = 0
    records_conflicts: int = 0
    protocol_duplicates: int = 0
    protocol_conflicts: int = 0

    def provenance(self) -> dict[str, Any]:
        """``on_conflict`` and each group of counts holding a non-zero one; ``{}`` when none does."""
        groups = (
            {
                "duplicates": self.duplicates,
                "conflicts": self.conflicts,
                "records_duplicates": self.records_duplicates,
                "records_conflicts": self.records_conflicts,
            },
            {
                "protocol_duplicates": self.protocol_duplicates,
                "protocol_conflicts": self.protocol_conflicts,
            },
        )
        shown = [group for group in groups if any(group.values())]
        if not shown:
            return {}
        return {"on_conflict": self.policy, **{k: v for group in shown for k, v in group.items()}}


@dataclass(frozen=True)
class IngestCommit:
    """The commit one ingest makes: its kind (``import`` or ``merge``), message and provenance."""

    kind: str
    message: str
    provenance: dict[str, Any] | None = field(default=None, repr=False)

    @classmethod
    def of(
        cls, kind: str, sources: IngestSources, counts: ConflictCounts | None = None
    ) -> IngestCommit:
        """The commit of an ingest of ``kind`` that read ``sources`` (``counts``: an import's)."""
        provenance = {
            **(sources.provenance or {}),
            **(counts.provenance() if counts is not None else {}),
        }
        return cls(kind, sources.message, provenance or None)

    def write(
        self,
        registry: RegistryAccess,
        entries: Iterable[NewEntry],
        *,
        records: RecordWrite | Iterable[NewRecord] = (),
        protocol_records: ProtocolWrite | Iterable[NewProtocolRecord] = (),
        removals: Iterable[tuple[Fingerprint, str, str]] = (),
        expected: Expected | None = None,
    ) -> WriteResult:
        """Write what the ingest chose as this one commit (none when nothing changes)."""
        with paused_gc():
            return registry.write(
                entries,
                kind=self.kind,
                message=self.message,
                provenance=self.provenance,
                removals=removals,
                expected=expected,
                records=records,
                protocol_records=protocol_records,
            )


__all__ = ["MAX_MESSAGE", "ConflictCounts", "IngestCommit", "IngestSources"]
