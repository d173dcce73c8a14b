"""What a warm start commits: rank 0's classification of what its ranks tuned, and the
commit's contents and counts (``ficache.sync``'s step 9 writes it).

This module owns the rules of the module docstring of ``ficache.sync`` under
"Shared or scoped" and "Concurrent servers", as plain functions over the
data rank 0 gathered: which new entries and records are stored shared and
which scoped to one rank of the layout, what the startup commit holds
(entries, provenance, message), and how its ``WriteResult`` becomes the
counts and warnings of the ``CommitOutcome``. It does not own the
collectives, the registry (``Registry.write`` decides, under its write
lock, what is kept), or reading the tuner.

Invariants:
- Pure: nothing here touches a registry, a process group or a tuner, and
  nothing heavier than ficache's value types is imported, so every rank may
  import it (``tests/test_start_imports.py``).
- Deterministic: keys and record identities are visited sorted, so the same
  gathered data gives the same commit on every run.
- A shared value is equal (runner, tactic, policy; a record's value) on
  every rank of a synchronized start; rank 0's row (with its selection)
  stands for it. Every other new value is stored once per rank that holds
  it. A key or tactic ficache cannot store is skipped and counted in a
  warning, never raised.
- A protocol record (FlashInfer 0.7.4, ``ficache.protocol_records``) is
  always stored shared: FlashInfer keeps one per environment, and its
  protocols publish on rank 0 and share the result themselves. Rank 0's
  value stands for it; one only other ranks published is stored when they
  all agree, and skipped with a warning when they do not (no rank's value is
  more right than another's).
- ``tally`` is the ``CommitOutcome`` being filled in (its fields by name);
  these functions only add to ``disagreements`` and ``warnings`` and set the
  counts of what was written.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_key
from ficache.scopes import SHARED_SCOPE, rank_scope
from ficache.tuner import Row, row_value
from ficache.values import NewEntry, WriteResult

#: The fields of a ``CommitOutcome`` being filled in, by name.
Tally = dict[str, Any]
#: Per rank, what it tuned: ``key -> row`` (an empty dict for a rank that sent nothing usable).
TunedByRank = list[dict[str, Row]]
#: A new record to store: ``(scope, namespace, key, value JSON)``.
RecordRow = tuple[str, str, str, str]
#: A new protocol record to store (shared): ``(namespace, key, value JSON)``.
ProtocolRow = tuple[str, str, str]


def selection_of(row: tuple[Any, ...]) -> str | None:
    """A row's selection (a fourth element), or None: another tuner may give three."""
    return row[3] if len(row) > 3 and isinstance(row[3], str) else None


def classify_entries(
    per_rank: TunedByRank, world: int, synchronized: bool, tally: Tally
) -> tuple[list[tuple[str, Row]], list[tuple[int, str, Row]]]:
    """The new entries as shared ``(key, row)`` and scoped ``(rank, key, row)``; counts
    disagreements, warns of keys or tactics it cannot store."""
    shared: list[tuple[str, Row]] = []
    scoped: list[tuple[int, str, Row]] = []
    invalid = 0
    for key in sorted(set().union(*per_rank)):
        values = [p.get(key) for p in per_rank]
        present = [v for v in values if v is not None]
        agree = len({row_value(v) for v in present}) <= 1  # selections differ per rank
        if len(present) >= 2 and not agree:
            tally["disagreements"] += 1
        try:
            fields = parse_key(key)
            if any(v[0] != fields.runner for v in present):
                raise ValueError("runner differs from the key's")
            for v in present:
                json.loads(v[1])
        except ValueError:
            invalid += 1
            continue
        if synchronized and len(present) == world and agree:
            shared.append((key, present[0]))  # rank 0's row, with rank 0's selection
        else:
            scoped.extend((r, key, v) for r, v in enumerate(values) if v is not None)
    if invalid:
        tally["warnings"].append(
            f"{invalid} tuned entries had keys or tactics ficache cannot store; skipped"
        )
    return shared, scoped


def classify_records(
    gathered: list[dict[str, dict[str, str]] | None],
    world: int,
    layout: str,
    synchronized: bool,
    tally: Tally,
) -> list[RecordRow]:
    """The new records as ``(scope, namespace, key, value)``; counts disagreements."""
    per_rank = [g if isinstance(g, dict) else {} for g in gathered]
    idents = sorted({(ns, key) for p in per_rank for ns, by in p.items() for key in by})
    out: list[RecordRow] = []
    for ns, key in idents:
        values = [p.get(ns, {}).get(key) for p in per_rank]
        present = [v for v in values if v is not None]
        if len(present) >= 2 and len(set(present)) > 1:
            tally["disagreements"] += 1
        if synchronized and len(present) == world and len(set(present)) == 1:
            out.append((SHARED_SCOPE, ns, key, present[0]))
        else:
            out.extend(
                (rank_scope(layout, r), ns, key, v) for r, v in enumerate(values) if v is not None
            )
    return out


def classify_protocol(
    gathered: list[dict[str, dict[str, str]] | None], tally: Tally
) -> list[ProtocolRow]:
    """The new protocol records to store shared (module docstring); counts disagreements and
    warns of the ones skipped."""
    per_rank = [g if isinstance(g, dict) else {} for g in gathered]
    idents = sorted({(ns, key) for p in per_rank for ns, by in p.items() for key in by})
    out: list[ProtocolRow] = []
    skipped = 0
    for ns, key in idents:
        values = [p.get(ns, {}).get(key) for p in per_rank]
        present = {v for v in values if v is not None}
        if len(present) > 1:
            tally["disagreements"] += 1
        if values and values[0] is not None:
            out.append((ns, key, values[0]))
        elif len(present) == 1:
            out.append((ns, key, present.pop()))
        else:
            skipped += 1
    if skipped:
        tally["warnings"].append(
            f"{skipped} protocol records not stored: ranks other than rank 0 published "
            "different values for them"
        )
    return out


@dataclass(frozen=True)
class StartupContents:
    """What the classification kept for the startup commit, by kind."""

    shared: list[tuple[str, Row]]
    scoped: list[tuple[int, str, Row]]
    records: list[RecordRow] = field(default_factory=list)
    protocol: list[ProtocolRow] = field(default_factory=list)


def commit_contents(
    fp: Fingerprint,
    per_rank: TunedByRank,
    contents: StartupContents,
    *,
    world: int,
    layout: str,
    synchronized: bool,
    disagreements: int,
    provenance: dict[str, Any],
) -> tuple[list[NewEntry], dict[str, Any], str]:
    """The startup commit's entries, provenance (the caller's, plus the start's) and message."""
    shared, scoped, records, protocol = (
        contents.shared,
        contents.scoped,
        contents.records,
        contents.protocol,
    )
    entries = [
        NewEntry(fp, k, v[0], v[1], v[2], SHARED_SCOPE, selection_json=selection_of(v))
        for k, v in shared
    ]
    entries += [
        NewEntry(fp, k, v[0], v[1], v[2], rank_scope(layout, r), selection_json=selection_of(v))
        for r, k, v in scoped
    ]
    recorded = {
        **provenance,
        "protocol": "ficache.warm_start",
        "world_size": world,
        "layout": layout,
        "fingerprint": fp.digest,
        "tuned_by_rank": [len(p) for p in per_rank],
        "shared": len(shared),
        "scoped": len(scoped),
        "disagreements": disagreements,
        "synchronized": synchronized,
    }
    if records:
        recorded["records"] = len(records)
    if protocol:
        recorded["protocol_records"] = len(protocol)
    keys = len(set().union(*per_rank))
    message = (
        f"startup on {world} rank(s) ({layout}): {keys} keys tuned"
        + (f", {len(records)} new records" if records else "")
        + (f", {len(protocol)} new protocol records" if protocol else "")
    )
    return entries, recorded, message


def count_written(written: WriteResult, tally: Tally) -> None:
    """What the commit wrote, into ``tally``: a key another server committed first is
    neither shared nor scoped, and is counted as kept, with a warning."""
    tally["committed"] = written.added + written.replaced
    tally["shared"] = written.shared_written
    tally["scoped"] = tally["committed"] - written.shared_written
    tally["records_committed"] = written.records_added + written.records_replaced
    if written.records_kept:
        tally["warnings"].append(
            f"{written.records_kept} published records not stored: the registry "
            "holds other values for those keys; every rank loads the stored ones"
        )
    tally["protocol_committed"] = written.protocol_added + written.protocol_replaced
    if written.protocol_kept:
        tally["warnings"].append(
            f"{written.protocol_kept} published protocol records not stored: the registry "
            "holds other values for those keys; every rank publishes the stored ones"
        )
    tally["kept"] = written.kept + written.records_kept + written.protocol_kept
    if written.kept:
        tally["warnings"].append(
            f"{written.kept} tuned values not stored: another server committed "
            "other values for those keys first; every rank loads the stored ones"
        )
    if written.skipped:  # the registry's older schema cannot hold some (rolling upgrades)
        tally["warnings"].append(written.skipped)
    tally["commit_id"] = written.commit_id
