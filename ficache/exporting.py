"""Exports: what a registry hands the format modules to write out.

This module owns the registry side of ``export``: which stored fingerprints,
entries and records an export holds, read from the registry and handed to a
format module (``ficache.bundle``, ``ficache.v2_store``) as plain data; the
format module turns that data into bytes and files and never opens a
registry. A FlashInfer file is ``export_file``: which stored fingerprints it
is taken from (one given, or those serving ``"current"``), rendered by
``Registry.export_for`` / ``export_text`` (``ficache.file_export``).

Invariants:
- It only reads the registry: an export never writes to it.
- A bundle is the entries, records and protocol records of the selected fingerprints (all:
  ``None``); an unknown fingerprint id, or a selection that holds nothing,
  is ``NotFoundError``; content a bundle cannot carry is ``BundleError``,
  and nothing is written.
- A v2 store export of a stored fingerprint uses its own metadata; of
  ``"current"``, the entries of every stored fingerprint that serves this
  environment under FlashInfer's own ``_collect_metadata()``, one
  environment directory per measurement policy the registry holds them
  under (``plan_v2_exports``). A fingerprint under a policy is written under
  it; a default one under the policy given, else the one the registry's
  commits recorded for it (newest first), else the default.
  It carries their protocol records too (``ficache.protocol_records``), as
  FlashInfer writes them into a store; no other export writes protocol
  records anywhere a v1 file's ``_records`` could hold them.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ficache.bundle import BundleSummary, Records, encode_bundle, publish_bundle
from ficache.errors import NotFoundError, V2StoreError
from ficache.kind_read import slice_values, stored_items, stored_rows
from ficache.kinds import PROTOCOL_KIND, RECORD_KIND
from ficache.models import SHARED_SCOPE
from ficache.registry import NewEntry, Registry, validate_scope
from ficache.v2_store import (
    StoreExport,
    export_measurement,
    measurement_label,
    measurements_in,
    store_export,
)


@dataclass(frozen=True)
class FileExport:
    """A FlashInfer cache file ``export`` writes: its text, its number of entries, and the
    stored fingerprints it was taken from."""

    text: str
    entries: int
    fingerprint_ids: tuple[int, ...]


def export_file(
    registry: Registry, fingerprint: int | str, *, scope: str = SHARED_SCOPE
) -> FileExport:
    """The FlashInfer cache file of a stored fingerprint (id or digest prefix) or ``"current"``.

    For ``"current"`` (``ficache.fingerprint.collect``) the entries come from
    every stored fingerprint that serves this environment, under its own
    ``_metadata`` (``Registry.export_for``; none serving it is
    ``NotFoundError``); else from that fingerprint alone, under its own.
    """
    if fingerprint == "current":
        from ficache.fingerprint import collect

        current = collect()
        text, count = registry.export_for(current, scope=scope)
        ids = [i.id for i in registry.serving(current)]
    else:
        info = registry.fingerprint(fingerprint)
        text, count = registry.export_text(info.id, scope=scope)
        ids = [info.id]
    return FileExport(text, count, tuple(ids))


def source_fingerprint_ids(registry: Registry, fingerprint: int | str) -> list[int]:
    """The stored fingerprints an export of ``fingerprint`` (an id, a digest prefix or
    ``"current"``: those serving this environment) takes its entries from."""
    if fingerprint == "current":
        from ficache.fingerprint import collect

        return [i.id for i in registry.serving(collect())]
    return [registry.fingerprint(fingerprint).id]


def write_bundle(
    registry: Registry, path: str | os.PathLike[str], fingerprint_ids: Sequence[int] | None
) -> BundleSummary:
    """Write the entries of ``fingerprint_ids`` (None: all) as one bundle at ``path``.

    What ``bundle_bytes`` renders, published with ``ficache.bundle.publish_bundle``.
    Raises what ``bundle_bytes`` raises, and ``BundleError`` when ``path``
    cannot be written.
    """
    target = Path(path)
    data, summary = bundle_bytes(registry, fingerprint_ids, path=target)
    publish_bundle(target, data)
    return summary


def bundle_bytes(
    registry: Registry, fingerprint_ids: Sequence[int] | None, *, path: Path
) -> tuple[bytes, BundleSummary]:
    """The bundle of the entries of ``fingerprint_ids`` (None: all), and its summary.

    ``path`` is where the bytes will go (named in the summary and in
    errors). Fingerprints without entries are left out (a bundle carries
    what it holds). Raises ``NotFoundError`` for an unknown id or when
    nothing would be bundled, ``BundleError`` when the registry holds an
    entry a bundle cannot carry.
    """
    infos = registry.fingerprints(ids=fingerprint_ids)
    if fingerprint_ids is not None:
        missing = sorted(set(fingerprint_ids) - {i.id for i in infos})
        if missing:
            raise NotFoundError(
                f"no fingerprint {missing[0]} in the registry; see `ficache fingerprints`"
            )
    by_id = {i.id: i.fingerprint for i in infos}
    rows = registry.entry_values(sorted(by_id))
    with registry.engine.connect() as conn:
        stored_records = stored_items(conn, RECORD_KIND, by_id, sorted(by_id))
        protocol = stored_items(conn, PROTOCOL_KIND, by_id, sorted(by_id))
    if not rows and not stored_records and not protocol:
        raise NotFoundError(
            "no entries to bundle in the selected fingerprints; see `ficache fingerprints`"
        )
    entries = [
        NewEntry(by_id[fid], key, runner, tactic, policy, scope, None, tuned_at, selection)
        for fid, scope, key, runner, tactic, policy, tuned_at, selection in rows
    ]
    records: Records = {}
    for r in stored_records:
        by_scope = records.setdefault(r.fingerprint.digest, {})
        by_scope.setdefault(r.scope, {}).setdefault(r.namespace, {})[r.key] = json.loads(
            r.value_json
        )
    record_fingerprints = [r.fingerprint for r in stored_records]
    return encode_bundle(
        entries, records, record_fingerprints, path=path, protocol_records=protocol
    )


def recorded_measurements(registry: Registry) -> dict[str, dict[str, str]]:
    """``fingerprint digest -> measurement fields`` of the newest commit that recorded each
    (``ficache.v2_store.measurements_in`` of every commit's provenance)."""
    return measurements_in(commit.provenance for commit in registry.log(None))  # newest first


def plan_v2_export(
    registry: Registry,
    fingerprint: int | str,
    *,
    scope: str = SHARED_SCOPE,
    measurement: Mapping[str, str] | None = None,
) -> StoreExport:
    """What ``export --v2-store`` writes for a stored fingerprint or ``"current"``, when that
    is one environment directory (``plan_v2_exports``; ``V2StoreError`` when it is several:
    ``"current"`` holding entries under more than one measurement policy)."""
    exports = plan_v2_exports(registry, fingerprint, scope=scope, measurement=measurement)
    if len(exports) > 1:
        labels = "; ".join(measurement_label(e.measurement) for e in exports)
        raise V2StoreError(
            f"the export is {len(exports)} environment directories ({labels}); "
            "use plan_v2_exports, or choose one with measurement="
        )
    return exports[0]


def plan_v2_exports(
    registry: Registry,
    fingerprint: int | str,
    *,
    scope: str = SHARED_SCOPE,
    measurement: Mapping[str, str] | None = None,
) -> tuple[StoreExport, ...]:
    """What ``export --v2-store`` writes for a stored fingerprint or ``"current"``: one
    environment directory per measurement policy, sorted by ``env_hash``.

    A fingerprint under a measurement policy (``Fingerprint.measurement``) is written under
    that policy (``measurement``, when given, must be it). A default one is written under
    ``measurement`` when given, else the policy its commits recorded (imports made before
    policies were fingerprints), else the default. For ``"current"`` the entries come from
    every stored fingerprint that serves this environment under each policy the registry
    holds (one directory each; with ``measurement``, that policy's alone, or, when nothing
    is stored under it, the default fingerprints written under it as before), and the
    manifest is FlashInfer's own ``_collect_metadata()``, so each lands where
    ``autotune_v2`` looks.
    """
    scopes = [SHARED_SCOPE] if validate_scope(scope) == SHARED_SCOPE else [SHARED_SCOPE, scope]
    if fingerprint != "current":
        groups, metadata = _stored_group(registry, fingerprint, measurement)
    else:
        groups, metadata = _current_groups(registry, measurement)
    recorded: dict[str, dict[str, str]] | None = None
    # Infos per chosen policy: a default fingerprint recorded under a policy that another
    # fingerprint holds lands in the same directory, after it (weaker in ``slice_rows``).
    by_policy: dict[str, tuple[list[Any], Mapping[str, str]]] = {}
    for infos, chosen in groups:
        if chosen is None:
            if recorded is None:
                recorded = recorded_measurements(registry)
            chosen = export_measurement(
                recorded, [i.fingerprint.digest for i in infos if i.entries]
            )
        held = by_policy.setdefault(json.dumps(dict(chosen), sort_keys=True), ([], chosen))
        held[0].extend(infos)
    exports = []
    for infos, chosen in by_policy.values():
        ids = [i.id for i in infos]
        export = store_export(
            metadata,
            chosen,
            registry.slice_rows(ids, scopes).values(),
            _slice_protocol(registry, ids, scopes),
        )
        with registry.engine.connect() as conn:
            records = slice_values(conn, RECORD_KIND, ids, scopes)
        left_out = sum(len(keys) for keys in records.values())
        exports.append(dataclasses.replace(export, records_left_out=left_out))
    return tuple(sorted(exports, key=lambda e: e.env_hash))


def _stored_group(
    registry: Registry, fingerprint: int | str, measurement: Mapping[str, str] | None
) -> tuple[list[tuple[list[Any], Mapping[str, str] | None]], dict[str, str]]:
    """A stored fingerprint's one ``(fingerprints, measurement)`` group and its metadata
    (``plan_v2_exports``): under its own policy, which ``measurement`` may not contradict."""
    info = registry.fingerprint(fingerprint)
    fp = info.fingerprint
    if fp.measurement:
        if measurement is not None and dict(measurement) != fp.measurement_fields:
            raise V2StoreError(
                f"fingerprint {info.id} was tuned under measurement policy "
                f"{measurement_label(fp.measurement_fields)}, not "
                f"{measurement_label(measurement)}; drop --measurement-policy"
            )
        measurement = fp.measurement_fields
    return [([info], measurement)], fp.flashinfer_metadata()


def _current_groups(
    registry: Registry, measurement: Mapping[str, str] | None
) -> tuple[list[tuple[list[Any], Mapping[str, str] | None]], dict[str, str]]:
    """``"current"``'s ``(fingerprints, measurement or None: as recorded)`` per directory,
    and FlashInfer's live metadata (``plan_v2_exports``)."""
    from flashinfer.autotuner import _collect_metadata

    from ficache.fingerprint import collect, measurement_json

    base = collect()
    held = sorted({i.fingerprint.measurement for i in registry.fingerprints()} - {""})
    if measurement is not None:
        wanted = measurement_json(measurement)
        held = [m for m in held if m == wanted]
    groups: list[tuple[list[Any], Mapping[str, str] | None]] = []
    policies: dict[str, list[Any]] = {}
    for text in held:
        infos = registry.serving(dataclasses.replace(base, measurement=text))
        if infos:
            policies[text] = infos
            groups.append((infos, json.loads(text)))
    if measurement is None or not policies:
        defaults = registry.serving(base)
        if defaults:
            groups.append((defaults, measurement))
    if not groups:
        raise NotFoundError(
            "no stored fingerprint serves the current environment; "
            "see `ficache fingerprints` and `ficache fingerprint`"
        )
    return groups, {str(k): str(v) for k, v in _collect_metadata().items()}


def _slice_protocol(
    registry: Registry, fingerprint_ids: Sequence[int], scopes: Sequence[str]
) -> list[tuple[str, str, str, str | None]]:
    """``(namespace, key, value, policy)`` of the protocol records a v2 export writes:
    ``scopes``' rows of ``fingerprint_ids``, earlier fingerprints and later scopes winning
    (as ``Registry.slice_rows`` chooses entries), by (namespace, key)."""
    rank = {fid: n for n, fid in enumerate(fingerprint_ids)}
    at = {scope: n for n, scope in enumerate(scopes)}
    best: dict[tuple[str, str], tuple[tuple[int, int], tuple[str, str, str, str | None]]] = {}
    with registry.engine.connect() as conn:
        for r in stored_rows(conn, PROTOCOL_KIND, fingerprint_ids=list(fingerprint_ids)):
            if r.scope not in at:
                continue
            order = (-rank[r.fingerprint_id], at[r.scope])
            held = best.get((r.namespace, r.key))
            if held is None or order > held[0]:
                best[r.namespace, r.key] = (
                    order,
                    (r.namespace, r.key, r.value_json, r.policy_json),
                )
    return [row for _order, row in sorted(best.values(), key=lambda b: b[1][:2])]


__all__ = [
    "FileExport",
    "bundle_bytes",
    "export_file",
    "plan_v2_export",
    "plan_v2_exports",
    "recorded_measurements",
    "source_fingerprint_ids",
    "write_bundle",
]
