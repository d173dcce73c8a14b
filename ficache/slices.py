"""Rank slices: what each rank of a layout loads from the registry, and their cache.

A rank's slice is the FlashInfer cache file it should load: the shared
entries plus the entries scoped to that rank of the layout
(``rank_scope(layout, rank)``), from every stored fingerprint that serves the
running environment (``Registry.serving``; exact fingerprint first), with the
running environment's ``_metadata`` so FlashInfer accepts it. Precedence is
``Registry.slice_rows``'s: an earlier fingerprint wins, and within one a
rank-scoped entry wins over a shared one.

Invariants:
- Namespaced records (``ficache.records``) ride in the same texts as
  ``_records``: the base holds the shared records, and a rank whose records
  differ (its scoped ones) gets an overlay holding all of its records,
  because FlashInfer's ``load_configs`` replaces the records it holds with
  the file's. Records are symmetric too (a record hit on one rank and a miss
  on another would desynchronize tuning the same way): when the ranks'
  record keys differ, every rank gets the shared records only, with a
  warning.
- FlashInfer 0.7.4's protocol records (``ficache.protocol_records``) are
  stored shared, so every rank gets the same ones (``RankSlices.protocol``):
  they never ride in the texts (a v1 file has no place for them); each rank
  publishes them after loading its text (``ficache.sync``).
- Slices are symmetric or shared-only. FlashInfer's synchronized tuning
  deadlocks when one rank hits where another misses, so when the ranks'
  slices differ in size (a rank's scoped entries were pruned, say) every
  rank gets the shared entries only and the rank-scoped ones are tuned
  again, with a warning.
- The slice cache is derived data, never a source of truth. Rendering 10k
  entries from SQL costs ~100x more than reading them back, so exports are
  kept in one file per (registry, fingerprint, layout) under the user cache
  dir, keyed by the registry's state (schema revision, last commit, entry
  count, last entry id and update time). Any commit or migration, and any
  out-of-band insert or delete, changes the state, and a stale, foreign,
  truncated or tampered cache file is a miss (every segment carries its
  SHA-256), never an error. It is written atomically and best-effort: a
  read-only cache dir only costs speed.
- A slice is rendered from the registry only after SQLite reported the file
  undamaged (``Registry.check_storage``, a ``PRAGMA quick_check``, cheap next
  to the rendering); a damaged file raises, and the start tunes uncached.
- Importing this module loads no SQLAlchemy (rendering from SQL imports the
  registry when it runs), so a warm start that hits the slice cache pays for
  no engine.
- ``cached_slices`` is the warm path for SQLite files: it reads the state
  over one plain read-only connection (``ficache.sqlite_fast``), without opening the registry
  (engine, Alembic checks), and only trusts a cache whose schema revision is
  this ficache's head; on any doubt it returns None and the caller takes
  the full path, which reports the registry's problems in its own words.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ficache import location as registry_location
from ficache import sqlite_fast
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import render_cache
from ficache.migration_files import declared_head
from ficache.publish import publish
from ficache.scopes import SHARED_SCOPE, rank_scope

if TYPE_CHECKING:
    from ficache.registry import Registry

FORMAT = 3  # 3: protocol records in the header
MAGIC = b"FICACHE-SLICES"

#: ``(last commit id, last commit time, entry count, last entry id, last entry update)``.
State = tuple[Any, ...]


@dataclass(frozen=True)
class RankSlices:
    """Every rank's slice of a layout: one base text plus, per rank, an overlay.

    Rank ``r`` loads ``base``, then ``overlays[r]`` when it is not None (its
    entries replace the base's for the same key), and then holds
    ``counts[r]`` entries. In the common case every overlay is None and all
    ranks load the same text.
    """

    base: str
    overlays: tuple[str | None, ...]
    counts: tuple[int, ...]
    fingerprint_ids: tuple[int, ...]
    state: State
    cache: str = "off"  # "hit", "miss" or "off"
    warnings: tuple[str, ...] = field(default=())
    record_counts: tuple[int, ...] = ()  # namespaced records each rank then holds
    #: ``{namespace: {key: canonical JSON}}``: the shared protocol records every rank publishes.
    protocol: dict[str, dict[str, str]] = field(default_factory=dict)

    @property
    def uniform(self) -> bool:
        return all(o is None for o in self.overlays)


def default_cache_dir() -> Path:
    from platformdirs import user_cache_dir

    return Path(user_cache_dir("ficache", appauthor=False)) / "slices"


def registry_state(reg: Registry) -> State:
    """A cheap token that changes whenever the registry's entries may have changed.

    ``sqlite_fast.STATE_SQL``: the schema revision, the last commit, and the
    count, last id and last update of entries, records and protocol records.
    Any commit, migration, or insert or delete made behind the registry's back
    changes it.
    """
    from sqlalchemy import text as sql_text
    from sqlalchemy.exc import DatabaseError

    from ficache import schema

    sql = sqlite_fast.state_sql(
        protocol_records=reg.features.has_table(sqlite_fast.PROTOCOL_RECORDS_TABLE)
    )
    try:
        with reg.engine.connect() as conn:
            return tuple(conn.execute(sql_text(sql)).one())
    except DatabaseError as exc:
        raise schema.translate_operational_error(exc, reg.location, engine=reg.engine) from None


@functools.lru_cache(maxsize=1)
def _head_revision() -> str:
    # The migration files' own declaration first: Alembic stays unloaded on the warm path.
    declared = declared_head()
    if declared is not None:
        return declared
    from ficache import schema

    return schema.head_revision()


def cached_slices(
    db: str | os.PathLike[str] | None,
    current: Fingerprint,
    layout: str,
    world: int,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
) -> tuple[RankSlices, str] | None:
    """The cached slices of a SQLite registry file, checked without opening the registry.

    The warm path: one read-only SQLite connection reads the registry's state
    and the cache file must match it, at the schema revision this ficache
    creates. Returns ``(slices, registry display name)``, or None on any
    doubt (not a SQLite file, no cache, a stale one, an older or newer schema,
    any error), after which the caller opens the registry as usual.
    """
    try:
        location = registry_location.resolve(db)
        if location.path is None or not location.path.is_file():
            return None
        directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        path = _cache_file(directory, location.url, current, layout, world)
        if not path.is_file():
            return None
        state = sqlite_fast.state(location.path)
        if state[0] != _head_revision():
            return None
    except Exception:  # noqa: BLE001 - any doubt: take the slow path, which explains itself
        return None
    cached = _read_cache(path, _header(location.url, current, layout, world, state))
    return (cached, location.display) if cached is not None else None


def _header(
    url: str, current: Fingerprint, layout: str, world: int, state: State
) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "url": url,
        "fingerprint": current.digest,
        "layout": layout,
        "world": world,
        "state": list(state),
    }


def _cache_file(cache_dir: Path, url: str, fp: Fingerprint, layout: str, world: int) -> Path:
    ident = json.dumps([url, fp.digest, layout, world])
    return cache_dir / (hashlib.sha256(ident.encode()).hexdigest()[:32] + ".slices")


def _read_cache(path: Path, header_want: dict[str, Any]) -> RankSlices | None:
    try:
        data = path.read_bytes()
    except OSError:
        return None
    try:
        head, sep, body = data.partition(b"\n")
        if not sep or not head.startswith(MAGIC + b" "):
            return None
        header = json.loads(head[len(MAGIC) + 1 :])
        if any(header.get(k) != v for k, v in header_want.items()):
            return None
        segments: list[str] = []
        offset = 0
        for length, digest in header["segments"]:
            chunk = body[offset : offset + length]
            offset += length
            if len(chunk) != length or hashlib.sha256(chunk).hexdigest() != digest:
                return None
            segments.append(chunk.decode("utf-8"))
        if offset != len(body):
            return None
        overlays = tuple(segments[i] if i is not None else None for i in header["overlays"])
        counts = tuple(int(n) for n in header["counts"])
        if len(overlays) != header_want["world"] or len(counts) != len(overlays):
            return None
        return RankSlices(
            segments[0],
            overlays,
            counts,
            tuple(header["fingerprint_ids"]),
            tuple(header["state"]),
            "hit",
            tuple(header.get("warnings", ())),
            tuple(int(n) for n in header["record_counts"]),
            _protocol_map(header["protocol"]),
        )
    except (ValueError, KeyError, TypeError, IndexError, UnicodeDecodeError, AttributeError):
        return None


def _write_cache(path: Path, header_base: dict[str, Any], slices: RankSlices) -> None:
    segments: list[bytes] = [slices.base.encode("utf-8")]
    overlays: list[int | None] = []
    for overlay in slices.overlays:
        if overlay is None:
            overlays.append(None)
        else:
            overlays.append(len(segments))
            segments.append(overlay.encode("utf-8"))
    header = {
        **header_base,
        "fingerprint_ids": list(slices.fingerprint_ids),
        "counts": list(slices.counts),
        "overlays": overlays,
        "segments": [[len(s), hashlib.sha256(s).hexdigest()] for s in segments],
        "warnings": list(slices.warnings),
        "record_counts": list(slices.record_counts),
        "protocol": slices.protocol,
    }
    data = b"".join(
        [MAGIC, b" ", json.dumps(header, separators=(",", ":")).encode(), b"\n", *segments]
    )
    # The same publication as every file ficache writes, without the fsync (the
    # cache is derived data that a crash may lose) and never into a FIFO or a
    # device (startup must not block on one planted there). Its mode follows the umask,
    # as the registry file's beside it does: it holds nothing the registry
    # does not, so it need not be more private than the registry.
    with contextlib.suppress(OSError):
        publish(path, data, durable=False, streams=False)


def export_slices(
    reg: Registry,
    current: Fingerprint,
    layout: str,
    world: int,
    *,
    cache_dir: str | os.PathLike[str] | None = None,
    use_cache: bool = True,
    for_tuning: bool = True,
) -> RankSlices:
    """Every rank's slice for ``current`` on ``layout`` of ``world`` ranks.

    ``for_tuning=False`` skips the symmetry rule (for slices loaded after
    tuning, when no rank profiles any more) and reads no cache, but still
    refreshes it when the slices are symmetric. Raises the registry's
    ``FicacheError`` subclasses when it cannot be read.
    """
    state = registry_state(reg)
    path = None
    header_want: dict[str, Any] = {}
    if use_cache:
        directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        path = _cache_file(directory, reg.location.url, current, layout, world)
        header_want = _header(reg.location.url, current, layout, world, state)
        cached = _read_cache(path, header_want) if for_tuning else None
        if cached is not None:
            return cached
    reg.check_storage()  # a damaged file serves nothing (a cache hit was checked when built)
    slices = _export(reg, current, layout, world, state, symmetric=for_tuning)
    if path is not None and len(set(slices.counts)) <= 1:
        _write_cache(path, header_want, slices)
        return dataclasses.replace(slices, cache="miss")
    return slices


def _export(
    reg: Registry, current: Fingerprint, layout: str, world: int, state: State, *, symmetric: bool
) -> RankSlices:
    metadata = current.flashinfer_metadata()
    ids = tuple(info.id for info in reg.serving(current))
    if not ids:
        return RankSlices(
            render_cache(metadata, ()), (None,) * world, (0,) * world, ids, state,
            record_counts=(0,) * world,
        )  # fmt: skip
    return dataclasses.replace(
        _export_texts(reg, metadata, ids, layout, world, state, symmetric=symmetric),
        protocol=reg.slice_protocol_records(ids),
    )


def _export_texts(
    reg: Registry,
    metadata: Any,
    ids: tuple[int, ...],
    layout: str,
    world: int,
    state: State,
    *,
    symmetric: bool,
) -> RankSlices:
    """The texts of every rank's slice from the fingerprints ``ids`` (at least one)."""
    shared = reg.slice_rows(ids, [SHARED_SCOPE])
    shared_records = reg.slice_records(ids, [SHARED_SCOPE])
    base = render_cache(metadata, shared.values(), shared_records)
    scopes = [rank_scope(layout, r) for r in range(world)]
    scoped_entries = any(reg.slice_rows(ids, [scope]) for scope in scopes)
    scoped_records = any(reg.slice_records(ids, [scope]) for scope in scopes)
    if not scoped_entries and not scoped_records:
        return RankSlices(
            base, (None,) * world, (len(shared),) * world, ids, state,
            record_counts=(_record_count(shared_records),) * world,
        )  # fmt: skip
    warnings: list[str] = []
    per_rank = [shared] * world
    if scoped_entries:
        per_rank = _symmetric_rows(reg, ids, scopes, shared, layout, symmetric, warnings)
    rank_records = [shared_records] * world
    if scoped_records:
        rank_records = _symmetric_records(
            reg, ids, scopes, shared_records, layout, symmetric, warnings
        )
    overlays = _overlays(metadata, shared, shared_records, per_rank, rank_records)
    return RankSlices(
        base,
        tuple(overlays),
        tuple(len(rows) for rows in per_rank),
        ids,
        state,
        warnings=tuple(warnings),
        record_counts=tuple(_record_count(records) for records in rank_records),
    )


def _symmetric_rows(
    reg: Registry,
    ids: tuple[int, ...],
    scopes: list[str],
    shared: Any,
    layout: str,
    symmetric: bool,
    warnings: list[str],
) -> list[Any]:
    """Each rank's entries (shared and its own scope); with ``symmetric``, the shared
    ones only where ranks would hold different numbers (a warning says so)."""
    per_rank = [reg.slice_rows(ids, [SHARED_SCOPE, scope]) for scope in scopes]
    counts = [len(rows) for rows in per_rank]
    if symmetric and len(set(counts)) > 1:
        warnings.append(
            f"rank-scoped entries of layout {layout!r} differ in number between ranks "
            f"({', '.join(map(str, counts))}); loading shared entries only, so that every "
            "rank tunes the same keys"
        )
        return [shared] * len(scopes)
    return per_rank


def _symmetric_records(
    reg: Registry,
    ids: tuple[int, ...],
    scopes: list[str],
    shared_records: dict[str, dict[str, str]],
    layout: str,
    symmetric: bool,
    warnings: list[str],
) -> list[dict[str, dict[str, str]]]:
    """Each rank's records, as ``_symmetric_rows`` its entries (keys, not numbers, compared)."""
    rank_records = [reg.slice_records(ids, [SHARED_SCOPE, scope]) for scope in scopes]
    keys = {frozenset((ns, k) for ns, by in recs.items() for k in by) for recs in rank_records}
    if symmetric and len(keys) > 1:
        warnings.append(
            f"rank-scoped records of layout {layout!r} differ in their keys between ranks; "
            "loading shared records only, so that every rank tunes the same keys"
        )
        return [shared_records] * len(scopes)
    return rank_records


def _overlays(
    metadata: Any,
    shared: Any,
    shared_records: dict[str, dict[str, str]],
    per_rank: list[Any],
    rank_records: list[dict[str, dict[str, str]]],
) -> list[str | None]:
    """Each rank's overlay over the shared base, None where it adds nothing."""
    overlays: list[str | None] = []
    for rows, records in zip(per_rank, rank_records, strict=True):
        # A rank's slice holds every shared key (more scopes only add candidates),
        # so base + overlay is exactly the slice. The overlay carries all of the
        # rank's records: loading it replaces the base's.
        differ = [row for key, row in rows.items() if shared.get(key) != row]
        if differ or records != shared_records:
            overlays.append(render_cache(metadata, differ, records))
        else:
            overlays.append(None)
    return overlays


def _protocol_map(value: Any) -> dict[str, dict[str, str]]:
    """A cache header's protocol records, checked to be ``{str: {str: str}}``."""
    if not isinstance(value, dict) or not all(
        isinstance(ns, str)
        and isinstance(by_key, dict)
        and all(isinstance(k, str) and isinstance(v, str) for k, v in by_key.items())
        for ns, by_key in value.items()
    ):
        raise ValueError("protocol records of a slice cache are not {str: {str: str}}")
    return value


def _record_count(records: dict[str, dict[str, str]]) -> int:
    return sum(len(by_key) for by_key in records.values())
