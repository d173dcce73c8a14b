"""FlashInfer's managed autotune store (``flashinfer.autotune_v2``), both ways.

The layout, as ``flashinfer/autotune_cache.py`` (``ManagedAutotuneCache``)
reads and writes it::

    <root>/v2/<env_hash>/manifest.json
    <root>/v2/<env_hash>/entries/<sha256(key)[:24]>.json

- ``manifest.json`` is ``flashinfer.autotuner._collect_metadata()`` plus the
  measurement policy's ``MeasurementPolicy.manifest_fields()`` (``measure_*``
  keys, empty for the default policy) plus ``"cache_schema": "v2"``.
  ``env_hash`` is the first 16 hex digits of the sha256 of the manifest's
  canonical JSON (sorted keys, no spaces). FlashInfer never reads the
  manifest: it computes ``env_hash`` from the running environment and the
  policy it attaches with, so a store serves only when the hash matches.
- An entry file holds ``key`` (the ``file_key`` string), ``runner``,
  ``tactic``, optional ``profiling_policy`` (the per-entry measurement
  provenance, the third element of a ``save_configs`` value) and optional
  ``key_fields`` (the key in a structural JSON form: ``{"__tuple__": [..]}``
  for tuples, ``{"__dtype__": name}`` for torch dtypes). ``lookup`` finds an
  entry by the hash of its key and requires the embedded key to match;
  ``preload`` (what ``autotune_v2`` hydrates from) also requires
  ``key_fields``, that ``str(key_fields) == key`` and that the file name is
  the hash of the key. Both write ``json.dump(obj, indent=2, sort_keys=True)``.
- Entries whose key is ``('__protocol__', namespace, key)`` are protocol
  records (arbitrary JSON, FlashInfer 0.7.4+), not tactics: FlashInfer's
  ``publish_protocol_record`` writes them with ``runner`` = namespace,
  ``tactic`` = the value and ``key_fields``, and serves them through
  ``get_protocol_records``, never through ``_records``. An import stores
  them as protocol records (``ficache.protocol_records``, a kind of their
  own, shared, with the entry file's ``profiling_policy`` when it has one);
  an export writes them back byte for byte as FlashInfer writes them. A
  protocol entry FlashInfer could not have written (a namespace or key that
  is not a string, a runner that is not its namespace, a value that is not
  finite JSON or nests deeper than ``flashinfer_format.MAX_RECORD_DEPTH``)
  is skipped and counted like a malformed entry.
- Root: ``FLASHINFER_AUTOTUNE_CACHE_DIR``, else FlashInfer's cache dir
  ``/autotune``; ``autotune_v2(cache_root=...)`` overrides both.

Measurement policy (where ficache keeps it):
- The per-entry ``profiling_policy`` is the entry's ``policy`` column, the
  same value a ``save_configs`` file carries as its third element, so v1 and
  v2 exports agree.
- The manifest's ``measure_*`` fields are part of FlashInfer's environment
  identity and of a ficache ``Fingerprint`` (``Fingerprint.measurement``):
  an environment's entries and protocol records are stored under its
  manifest's fingerprint with its policy, so one environment tuned under
  several policies is several fingerprints, imported in one commit, merged
  without replacing each other, and exported each to its own directory
  (``ficache.exporting.plan_v2_exports``). Every commit that stores a
  store's entries (``importing.import_stores``, and vLLM adoption in ``ficache.adopt``)
  records them in one shape, written by one helper (``environments_provenance``):
  provenance key ``v2_environments``, a list of ``{path, env_hash,
  fingerprint (digest), measurement, entries, skipped_entries, records}``
  (``StoredEnvironment``). ``measurements_in`` reads that key from any
  commit, and the ``environments`` key that imports wrote before it (``source:
  "flashinfer-v2-store"``). A fingerprint with a policy exports under it; a
  default-policy one (imported before policies were fingerprints, or from a
  v1 file) uses, in order: the policy given (``measurement=``), else the
  newest policy a commit recorded for it, else the default (no
  ``measure_*`` fields). So an imported or adopted environment exports to
  the same ``env_hash``.

Invariants:
- Reading never evaluates anything: keys are parsed by
  ``flashinfer_format`` (``parse_key``), tactics and policies must be JSON
  numbers, strings and lists. A malformed entry (unreadable, invalid JSON,
  missing fields, a file name that is not the hash of its key, a runner
  that differs from the key's, a hostile key) is skipped and counted, as
  FlashInfer treats it as a miss; a malformed manifest (missing, invalid,
  not hashing to its directory's name, fields ficache cannot reproduce)
  skips its whole environment, counted. So does an environment whose entry
  files change while they are read (listed, sized and dated before and
  after: another process writes the store), ``Skipped.changed``: a store is
  never half-read. A path that is neither a store root nor an environment
  directory raises ``V2StoreError``.
- All environments of one import are one commit.
- Exports are deterministic: every file is a pure function of the stored
  entries and the manifest, written with FlashInfer's own JSON layout, so
  exporting twice gives byte-identical files (and files that FlashInfer's
  own ``publish`` would write byte for byte). Each file is published by
  ``ficache.publish.publish``, atomically (temp file in its directory,
  ``os.replace``): a new file follows the umask (a server running as
  another user reads the store) and a replaced one keeps its mode; a file
  whose bytes are already right is left alone.
- An export writes only its environment's manifest and the entry files of
  the keys it exports; it never deletes or rewrites anything else. It
  writes only into a store root, an empty directory or a new one, and
  refuses an environment directory whose manifest differs from its own.
- The export side translates only: ``store_export`` turns given rows,
  metadata and measurement fields into files, ``measurements_in`` and
  ``export_measurement`` read given provenance; it never opens a registry.
  What a registry exports is read by ``ficache.exporting``
  (``plan_v2_export``, ``recorded_measurements``).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ficache import tuned_time
from ficache.errors import FingerprintError, V2StoreError
from ficache.fingerprint import FLASHINFER_FIELDS, Fingerprint
from ficache.flashinfer_format import (
    _TOKEN,
    FileEntry,
    _check_entry,
    _unquote,
    check_protocol_identity,
    protocol_policy_json,
    protocol_value_json,
)
from ficache.publish import publish
from ficache.scopes import SHARED_SCOPE
from ficache.values import NewEntry, NewProtocolRecord, validate_scope

SCHEMA = "v2"
SCHEMA_KEY = "cache_schema"
MANIFEST = "manifest.json"
ENTRIES = "entries"
MEASURE_PREFIX = "measure_"
PROTOCOL_KEY = "__protocol__"
#: ``source`` of the provenance an import commit records.
PROVENANCE_SOURCE = "flashinfer-v2-store"
#: The provenance key under which a commit lists the v2 environments it stored
#: (``environments_provenance``; what ``measurements_in`` reads).
ENVIRONMENTS_KEY = "v2_environments"
#: Where imports recorded them before ``ENVIRONMENTS_KEY`` (read, never written).
LEGACY_ENVIRONMENTS_KEY = "environments"
#: Largest entry or manifest file read (a real one is a few hundred bytes).
MAX_FILE_BYTES = 1024 * 1024
#: Skipped items kept (with reasons) per environment and in provenance.
MAX_REASONS = 20

#: ``MeasurementPolicy`` attributes an export may set, as ``FIELD=VALUE``.
POLICY_ATTRIBUTES = ("execution_mode", "cold_l2", "timer", "graph_timing")


# --------------------------------------------------------------------------
# Identity: manifests and hashes, as FlashInfer computes them.


def canonical_manifest_json(manifest: Mapping[str, str]) -> str:
    """FlashInfer's canonical JSON of a manifest (what ``env_hash`` hashes)."""
    return json.dumps(dict(manifest), sort_keys=True, separators=(",", ":"))


def manifest_for(metadata: Mapping[str, str], measurement: Mapping[str, str]) -> dict[str, str]:
    """The manifest of an environment: metadata, measurement fields, schema."""
    manifest = {**metadata, **measurement}
    manifest[SCHEMA_KEY] = SCHEMA
    return manifest


def env_hash(manifest: Mapping[str, str]) -> str:
    return hashlib.sha256(canonical_manifest_json(manifest).encode()).hexdigest()[:16]


def entry_file_name(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()[:24] + ".json"


def _flashinfer_json(value: Any) -> str:
    """The bytes FlashInfer's ``_atomic_write_json`` writes for ``value``."""
    return json.dumps(value, indent=2, sort_keys=True)


def measurement_label(measurement: Mapping[str, str]) -> str:
    """``execution_mode=cuda_graph,cold_l2=True`` or ``default``."""
    if not measurement:
        return "default"
    return ",".join(f"{k.removeprefix(MEASURE_PREFIX)}={v}" for k, v in sorted(measurement.items()))


def parse_measurement_policy(spec: str) -> dict[str, str]:
    """The manifest fields of the policy ``spec`` names (``default`` or ``F=V,...``).

    ``F`` is a ``flashinfer.MeasurementPolicy`` attribute (``execution_mode``,
    ``cold_l2``, ``timer``, ``graph_timing``); FlashInfer's own class checks
    the values and computes the fields, so the result is what
    ``autotune_v2(measurement_policy=...)`` hashes.
    """
    text = spec.strip()
    if text in ("", "default"):
        return {}
    kwargs: dict[str, Any] = {}
    for part in text.split(","):
        name, sep, value = (s.strip() for s in part.partition("="))
        if not sep or name not in POLICY_ATTRIBUTES or not value:
            raise V2StoreError(
                f"measurement policy {spec!r}: expected `default` or FIELD=VALUE[,...] "
                f"with FIELD one of {', '.join(POLICY_ATTRIBUTES)}"
            )
        if name == "cold_l2":
            if value.lower() not in ("true", "false"):
                raise V2StoreError(f"measurement policy {spec!r}: cold_l2 is true or false")
            kwargs[name] = value.lower() == "true"
        else:
            kwargs["_timer" if name == "timer" else name] = value
    try:
        from flashinfer.autotune_cache import MeasurementPolicy
    except ImportError as exc:
        raise V2StoreError(
            f"this FlashInfer has no MeasurementPolicy ({exc}); drop --measurement-policy"
        ) from None
    try:
        policy = MeasurementPolicy(**kwargs)
    except (TypeError, ValueError) as exc:
        raise V2StoreError(f"measurement policy {spec!r}: {exc}") from None
    return {str(k): str(v) for k, v in policy.manifest_fields().items()}


# --------------------------------------------------------------------------
# key_fields: the structural form of a key, built without eval.


class _TorchDtype:
    """``torch.<name>`` in a key; its repr is the text torch prints."""

    __slots__ = ("name",)

    def __init__(self, name: str) -> None:
        self.name = name

    def __repr__(self) -> str:
        return f"torch.{self.name}"


_NAMES: dict[str, Any] = {
    "None": None,
    "True": True,
    "False": False,
    "inf": float("inf"),
    "-inf": float("-inf"),
    "nan": float("nan"),
}


def _key_value(key: str) -> Any:
    """The Python value whose ``str()`` ``key`` claims to be, or ``None``.

    Lenient on purpose: the caller checks ``str(value) == key``, which only
    an exact reading passes. Lists stay lists and tuples tuples (FlashInfer
    encodes them differently).
    """
    items: list[list[Any]] = [[]]
    openers: list[str] = []
    for m in _TOKEN.finditer(key):
        kind, token = m.lastgroup, m.group()
        if kind in ("ws", "comma"):
            continue
        value: Any
        if kind == "open":
            items.append([])
            openers.append(token)
            continue
        if kind == "close":
            if not openers:
                return None
            children = items.pop()
            value = tuple(children) if openers.pop() == "(" else children
        elif kind == "str":
            value = _unquote(token)
        elif kind == "num":
            value = float(token) if any(c in token for c in ".eE") else int(token)
        elif kind == "name" and token in _NAMES:
            value = _NAMES[token]
        elif kind == "name" and token.count(".") == 1 and token.startswith("torch."):
            value = _TorchDtype(token.removeprefix("torch."))
        else:
            return None
        items[-1].append(value)
    if openers or len(items[0]) != 1:
        return None
    return items[0][0]


def _encode(value: Any) -> Any:
    if isinstance(value, _TorchDtype):
        return {"__dtype__": value.name}
    if isinstance(value, tuple):
        return {"__tuple__": [_encode(v) for v in value]}
    if isinstance(value, list):
        return [_encode(v) for v in value]
    return value  # None, bool, int, float, str


def encode_key_fields(key: str) -> Any | None:
    """FlashInfer's ``key_fields`` for ``key``, or ``None`` when it has none.

    ``None`` (like FlashInfer's own encoder) for a key holding anything but
    strings, numbers, ``None``, booleans, torch dtypes, tuples and lists:
    such an entry is served by ``lookup`` and not preloaded.
    """
    value = _key_value(key)
    if not isinstance(value, tuple) or str(value) != key:
        return None
    return _encode(value)


def _is_protocol_key(key: str) -> bool:
    """Whether ``key`` claims to be a protocol record's (``('__protocol__', ...)``)."""
    return key.startswith((f"('{PROTOCOL_KEY}'", f'("{PROTOCOL_KEY}"'))


def protocol_file_key(namespace: str, key: str) -> str:
    """The entry key FlashInfer stores a protocol record under: ``str(('__protocol__',
    namespace, key))`` (Python's own text of a tuple of strings; nothing is evaluated)."""
    return str((PROTOCOL_KEY, namespace, key))


@dataclass(frozen=True)
class ProtocolEntry:
    """One protocol record of a v2 environment, as its entry file held it."""

    namespace: str
    key: str
    value_json: str  # canonical JSON
    policy_json: str | None  # the entry file's profiling_policy, canonical JSON; None: none


def _protocol_entry(key: str, data: Mapping[str, Any]) -> ProtocolEntry:
    """A protocol entry file's record; ``ValueError`` for one FlashInfer could not have
    written (its key is not ``str(('__protocol__', namespace, key))`` of two strings, its
    runner not its namespace, its value not finite JSON or too deep)."""
    fields = _key_value(key)
    if not (
        isinstance(fields, tuple)
        and len(fields) == 3
        and fields[0] == PROTOCOL_KEY
        and all(isinstance(f, str) for f in fields)
        and protocol_file_key(fields[1], fields[2]) == key
    ):
        raise ValueError("protocol key is not ('__protocol__', namespace, key) of strings")
    _, namespace, record_key = fields
    check_protocol_identity(namespace, record_key)
    if data["runner"] != namespace:
        raise ValueError("protocol record's runner is not its namespace")
    try:
        value = protocol_value_json(data["tactic"])
        policy = protocol_policy_json(data.get("profiling_policy"))
    except ValueError as exc:
        raise ValueError(f"protocol record value refused: {exc}") from None
    return ProtocolEntry(namespace, record_key, value, policy)


# --------------------------------------------------------------------------
# Reading a store.


@dataclass(frozen=True)
class Skipped:
    """A file or directory left out, and why."""

    path: str
    reason: str
    #: An environment whose entry files changed while they were read (another writer).
    changed: bool = False

    def __str__(self) -> str:
        return f"{self.path}: {self.reason}"


class StoreChangedError(ValueError):
    """An environment's entry files changed while they were read: nothing is taken from it."""


@dataclass(frozen=True)
class StoreEnvironment:
    """One ``<root>/v2/<env_hash>`` directory as read."""

    path: Path
    env_hash: str
    fingerprint: Fingerprint
    measurement: tuple[tuple[str, str], ...]  # the manifest's measure_* fields, sorted
    entries: tuple[FileEntry, ...]
    records: int  # protocol records (``protocol``)
    skipped: int  # malformed entries
    first_skipped: tuple[Skipped, ...]  # the first MAX_REASONS of them
    #: When each of ``entries`` was tuned: its entry file's mtime (``tuned_time.tuned_at``).
    tuned_at: tuple[float, ...] = ()
    #: Its protocol records, with their entry files' mtimes, in file name order.
    protocol: tuple[tuple[ProtocolEntry, float], ...] = ()

    @property
    def measurement_fields(self) -> dict[str, str]:
        return dict(self.measurement)

    @property
    def stored_fingerprint(self) -> Fingerprint | None:
        """The fingerprint an import stores this environment under, or None where it holds
        nothing to store (no entry or protocol record, say only malformed entries): no
        fingerprint is then created, so none is reported for ``export --fingerprint``."""
        return self.fingerprint if self.entries or self.records else None


@dataclass(frozen=True)
class StoreContents:
    """Every environment of a store root, or one environment directory."""

    source: Path
    environments: tuple[StoreEnvironment, ...]
    skipped_environments: tuple[Skipped, ...]

    @property
    def entries(self) -> int:
        return sum(len(e.entries) for e in self.environments)

    @property
    def skipped_entries(self) -> int:
        return sum(e.skipped for e in self.environments)

    @property
    def records(self) -> int:
        return sum(e.records for e in self.environments)


@dataclass(frozen=True)
class StoredEnvironment:
    """What a commit records of one environment whose entries it stored.

    Its ``as_json`` is the one shape every such commit's provenance holds
    (``environments_provenance``), and ``measurement`` is what a later
    ``export --v2-store`` reads back (``measurements_in``).
    """

    path: Path
    env_hash: str
    fingerprint: str  # digest
    measurement: tuple[tuple[str, str], ...]  # the manifest's measure_* fields, sorted
    entries: int
    skipped: int  # malformed entry files
    records: int  # protocol records (``ficache.protocol_records``)

    @classmethod
    def of(cls, env: StoreEnvironment) -> StoredEnvironment:
        return cls(
            env.path,
            env.env_hash,
            env.fingerprint.digest,
            env.measurement,
            len(env.entries),
            env.skipped,
            env.records,
        )

    @property
    def files(self) -> int:
        return self.entries + self.skipped + self.records

    def as_json(self) -> dict[str, Any]:
        return {
            "path": str(self.path),
            "env_hash": self.env_hash,
            "fingerprint": self.fingerprint,
            "measurement": dict(self.measurement),
            "entries": self.entries,
            "skipped_entries": self.skipped,
            "records": self.records,
        }


def environments_provenance(stored: Sequence[StoredEnvironment]) -> dict[str, Any]:
    """The provenance item of a commit that stores the entries of ``stored``.

    The only writer of the shape ``measurements_in`` reads: every path
    that stores v2 entries merges this into its commit's provenance.
    """
    return {ENVIRONMENTS_KEY: [s.as_json() for s in stored]}


def is_environment_dir(path: Path) -> bool:
    return path.is_dir() and (path / MANIFEST).exists()


def is_store_root(path: Path) -> bool:
    return path.is_dir() and (path / SCHEMA).is_dir()


def read_store(
    path: str | os.PathLike[str], *, hint: Callable[[Path], str] | None = None
) -> StoreContents:
    """Read a store root (every environment) or one environment directory.

    Raises ``V2StoreError`` when ``path`` is neither, saying what it looked
    for and ending with ``hint(path)`` (what to give instead; the CLI's
    ``ficache.ingest.import_hint``). Malformed entries and environments are
    skipped and counted, never raised.
    """
    source = Path(path)
    if is_store_root(source):
        try:
            env_dirs = sorted(p for p in (source / SCHEMA).iterdir() if p.is_dir())
        except OSError as exc:
            raise V2StoreError(f"{source / SCHEMA}: cannot list ({exc.strerror})") from None
    elif is_environment_dir(source):
        env_dirs = [source]
    else:
        raise V2StoreError(
            f"{source}: not a FlashInfer v2 store (no {SCHEMA}/ directory) nor one of its "
            f"environment directories (no {MANIFEST}); "
            + (hint(source) if hint is not None else "give the store root")
        )
    environments: list[StoreEnvironment] = []
    skipped: list[Skipped] = []
    for env_dir in env_dirs:
        try:
            environments.append(_read_environment(env_dir))
        except StoreChangedError as exc:
            skipped.append(Skipped(str(env_dir), str(exc), changed=True))
        except ValueError as exc:
            skipped.append(Skipped(str(env_dir), str(exc)))
    return StoreContents(source, tuple(environments), tuple(skipped))


def _read_json(path: Path) -> Any:
    """A small JSON file's value; ``ValueError`` saying why it cannot be read."""
    try:
        if not path.is_file():
            raise ValueError("not a regular file")
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ValueError(f"larger than {MAX_FILE_BYTES} bytes")
        return json.loads(path.read_bytes().decode("utf-8"))
    except UnicodeDecodeError:
        raise ValueError("not UTF-8 text") from None
    except json.JSONDecodeError as exc:
        raise ValueError(f"invalid JSON ({exc})") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    except OSError as exc:
        raise ValueError(f"cannot read ({exc.strerror})") from None


def _read_manifest(env_dir: Path) -> tuple[Fingerprint, tuple[tuple[str, str], ...], str]:
    path = env_dir / MANIFEST
    if not path.exists():
        raise ValueError(f"no {MANIFEST}")
    try:
        manifest = _read_json(path)
    except ValueError as exc:
        raise ValueError(f"{MANIFEST}: {exc}") from None
    if not isinstance(manifest, dict):
        raise ValueError(f"{MANIFEST} is not a JSON object")
    if manifest.get(SCHEMA_KEY) != SCHEMA:
        raise ValueError(f"{MANIFEST}: {SCHEMA_KEY} is {manifest.get(SCHEMA_KEY)!r}, not 'v2'")
    if not all(isinstance(v, str) for v in manifest.values()):
        raise ValueError(f"{MANIFEST}: every value must be a string")
    missing = [f for f in FLASHINFER_FIELDS if f not in manifest]
    if missing:
        raise ValueError(f"{MANIFEST} lacks {', '.join(missing)}")
    unknown = sorted(
        k
        for k in manifest
        if k not in FLASHINFER_FIELDS and k != SCHEMA_KEY and not k.startswith(MEASURE_PREFIX)
    )
    if unknown:
        raise ValueError(
            f"{MANIFEST} has field(s) ficache does not know ({', '.join(unknown)}); "
            "a newer FlashInfer wrote it"
        )
    digest = env_hash(manifest)
    if digest != env_dir.name:
        raise ValueError(
            f"{MANIFEST} hashes to {digest}, not to its directory's name, "
            "so FlashInfer never serves it"
        )
    try:
        fingerprint = Fingerprint.from_flashinfer_metadata(
            {f: manifest[f] for f in FLASHINFER_FIELDS}
        )
    except FingerprintError as exc:
        raise ValueError(f"{MANIFEST}: {exc}") from None
    measurement = tuple(sorted((k, v) for k, v in manifest.items() if k.startswith(MEASURE_PREFIX)))
    # The policy is part of the environment, as it is of FlashInfer's env_hash.
    return fingerprint.with_measurement(dict(measurement)), measurement, digest


def _read_entry(path: Path) -> FileEntry | ProtocolEntry:
    """One entry file: a ``FileEntry``, a ``ProtocolEntry`` for a protocol record, else
    ``ValueError``."""
    data = _read_json(path)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    key, runner = data.get("key"), data.get("runner")
    if not isinstance(key, str) or not isinstance(runner, str) or "tactic" not in data:
        raise ValueError("needs a string key, a string runner and a tactic")
    if path.name != entry_file_name(key):
        raise ValueError("file name is not the hash of its key")
    if _is_protocol_key(key):
        return _protocol_entry(key, data)
    value = [runner, data["tactic"]]
    policy = data.get("profiling_policy")
    if policy is not None:
        value.append(policy)
    return _check_entry(key, value)


def entries_signature(entries_dir: Path) -> tuple[tuple[str, int, int, int], ...]:
    """``(name, inode, size, mtime_ns)`` of every file of ``entries_dir`` (empty when it is
    absent): what changes when a writer adds, removes or rewrites an entry file (FlashInfer
    replaces a file with a new one, a new inode, even within one mtime tick)."""
    try:
        return tuple(
            sorted(
                (p.name, st.st_ino, st.st_size, st.st_mtime_ns)
                for p in entries_dir.iterdir()
                for st in (p.stat(),)
            )
        )
    except FileNotFoundError:
        return ()
    except OSError as exc:
        raise ValueError(f"{ENTRIES}: cannot list ({exc.strerror})") from None


def _read_environment(env_dir: Path) -> StoreEnvironment:
    """One environment directory; ``ValueError`` for a bad manifest, or for entry files that
    changed while they were read (listed, sized and dated before and after): a store being
    written is never half-read."""
    fingerprint, measurement, digest = _read_manifest(env_dir)
    entries_dir = env_dir / ENTRIES
    before = entries_signature(entries_dir)
    environment = _read_entries(env_dir, fingerprint, measurement, digest)
    if entries_signature(entries_dir) != before:
        raise StoreChangedError(
            f"{ENTRIES} changed while it was read; nothing taken from it "
            "(stop other writers to that store root)"
        )
    return environment


def _read_entries(
    env_dir: Path,
    fingerprint: Fingerprint,
    measurement: tuple[tuple[str, str], ...],
    digest: str,
) -> StoreEnvironment:
    entries_dir = env_dir / ENTRIES
    entries: list[FileEntry] = []
    tuned: list[float] = []
    skipped: list[Skipped] = []
    protocol: list[tuple[ProtocolEntry, float]] = []
    n_skipped = 0
    if entries_dir.exists():
        if not entries_dir.is_dir():
            raise ValueError(f"{ENTRIES} is not a directory")
        try:
            paths = sorted(entries_dir.glob("*.json"))
        except OSError as exc:
            raise ValueError(f"{ENTRIES}: cannot list ({exc.strerror})") from None
        for path in paths:
            try:
                entry = _read_entry(path)
            except (ValueError, RecursionError) as exc:
                n_skipped += 1
                if len(skipped) < MAX_REASONS:
                    skipped.append(Skipped(str(path), str(exc)))
                continue
            if isinstance(entry, ProtocolEntry):
                protocol.append((entry, tuned_time.tuned_at(None, path)))
            else:
                entries.append(entry)
                tuned.append(tuned_time.tuned_at(None, path))
    return StoreEnvironment(
        env_dir,
        digest,
        fingerprint,
        measurement,
        tuple(entries),
        len(protocol),
        n_skipped,
        tuple(skipped),
        tuple(tuned),
        tuple(protocol),
    )


# --------------------------------------------------------------------------
# Import.


def store_entries(store: StoreContents, scope: str = SHARED_SCOPE) -> tuple[NewEntry, ...]:
    """Every entry of ``store``'s environments under ``scope``, each dated by its entry
    file's mtime, as adoption dates it (``StoreEnvironment.tuned_at``)."""
    validate_scope(scope)
    return tuple(
        NewEntry(
            env.fingerprint,
            e.key,
            e.runner,
            e.tactic_json,
            e.policy_json,
            scope,
            e.fields,
            at,
        )
        for env in store.environments
        for e, at in zip(env.entries, env.tuned_at, strict=True)
    )


def store_protocol_records(store: StoreContents) -> tuple[NewProtocolRecord, ...]:
    """Every protocol record of ``store``'s environments, stored shared (FlashInfer keeps
    one per namespace and key for every rank), each dated by its entry file's mtime."""
    return tuple(
        NewProtocolRecord(
            env.fingerprint, p.namespace, p.key, p.value_json, p.policy_json, SHARED_SCOPE, at
        )
        for env in store.environments
        for p, at in env.protocol
    )


def stores_provenance(stores: Sequence[StoreContents]) -> dict[str, Any]:
    """An import commit's provenance: each environment's hash, fingerprint digest and
    measurement policy (what a later export reads back)."""
    environments: list[StoredEnvironment] = []
    skipped_environments: list[dict[str, str]] = []
    for store in stores:
        for env in store.environments:
            environments.append(StoredEnvironment.of(env))
        skipped_environments.extend(
            {"path": s.path, "reason": s.reason} for s in store.skipped_environments
        )
    provenance: dict[str, Any] = {
        "source": PROVENANCE_SOURCE,
        **environments_provenance(environments),
    }
    if skipped_environments:
        provenance["skipped_environments"] = skipped_environments[:MAX_REASONS]
    return provenance


def measurements_in(provenances: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, str]]:
    """``fingerprint digest -> measurement fields`` of the first provenance that recorded each.

    Give commits' provenance newest first (``ficache.exporting.recorded_measurements``
    does). Reads ``ENVIRONMENTS_KEY`` (``environments_provenance``), and
    ``LEGACY_ENVIRONMENTS_KEY`` of imports written before it.
    """
    found: dict[str, dict[str, str]] = {}
    for provenance in provenances:
        environments = provenance.get(ENVIRONMENTS_KEY)
        if environments is None and provenance.get("source") == PROVENANCE_SOURCE:
            environments = provenance.get(LEGACY_ENVIRONMENTS_KEY)
        if not isinstance(environments, list):
            continue
        for env in environments:
            if not isinstance(env, dict):
                continue
            digest, measurement = env.get("fingerprint"), env.get("measurement")
            if isinstance(digest, str) and isinstance(measurement, dict):
                found.setdefault(digest, {str(k): str(v) for k, v in measurement.items()})
    return found


# --------------------------------------------------------------------------
# Export.


@dataclass(frozen=True)
class StoreExport:
    """The files one environment of a store should hold; ``write`` publishes them."""

    manifest: tuple[tuple[str, str], ...]
    env_hash: str
    files: tuple[tuple[str, str], ...]  # (entry file name, text), sorted by name
    not_preloadable: int  # entries without key_fields (served by lookup only)
    protocol_records: int = 0  # of ``files``, protocol records
    #: Namespaced records (``_records``) of the slice that a v2 store has no place for:
    #: left out (``ficache.exporting.plan_v2_export`` counts them, the CLI warns).
    records_left_out: int = 0

    @property
    def measurement(self) -> dict[str, str]:
        return {k: v for k, v in self.manifest if k.startswith(MEASURE_PREFIX)}

    @property
    def manifest_text(self) -> str:
        return _flashinfer_json(dict(self.manifest))

    def write(self, root: str | os.PathLike[str]) -> ExportResult:
        return _write_store(Path(root), self)


@dataclass(frozen=True)
class ExportResult:
    env_dir: Path
    written: int
    unchanged: int


def _entry_text(
    key: str, runner: str, tactic_json: str, policy_json: str | None
) -> tuple[str, bool]:
    entry: dict[str, Any] = {"key": key, "runner": runner, "tactic": json.loads(tactic_json)}
    if policy_json is not None:
        entry["profiling_policy"] = json.loads(policy_json)
    key_fields = encode_key_fields(key)
    if key_fields is not None:
        entry["key_fields"] = key_fields
    return _flashinfer_json(entry), key_fields is not None


def _protocol_text(namespace: str, key: str, value_json: str, policy_json: str | None) -> str:
    """A protocol record's entry file, as ``publish_protocol_record(persist=True)`` writes it."""
    file_key = protocol_file_key(namespace, key)
    entry: dict[str, Any] = {"key": file_key, "runner": namespace, "tactic": json.loads(value_json)}
    if policy_json is not None:
        entry["profiling_policy"] = json.loads(policy_json)
    entry["key_fields"] = encode_key_fields(file_key)
    return _flashinfer_json(entry)


def export_measurement(
    recorded: Mapping[str, Mapping[str, str]], digests: Iterable[str]
) -> dict[str, str]:
    """The measurement policy an export of the fingerprints ``digests`` is written under.

    ``recorded``: what ``measurements_in`` found. The one policy recorded for
    them, else the default (no ``measure_*`` fields); ``V2StoreError`` when
    they were recorded under more than one (the caller must choose).
    """
    policies = {
        canonical_manifest_json(recorded[digest]): dict(recorded[digest])
        for digest in digests
        if digest in recorded
    }
    if len(policies) > 1:
        labels = sorted(measurement_label(p) for p in policies.values())
        raise V2StoreError(
            f"the exported entries were imported under {len(policies)} measurement policies "
            f"({'; '.join(labels)}); choose one with --measurement-policy"
        )
    return next(iter(policies.values()), {})


def store_export(
    metadata: Mapping[str, str],
    measurement: Mapping[str, str],
    rows: Iterable[tuple[str, str, str, str | None, str | None]],
    protocol: Iterable[tuple[str, str, str, str | None]] = (),
) -> StoreExport:
    """The files of one environment: ``metadata`` and ``measurement`` make its manifest,
    ``rows`` (``(key, runner, tactic, policy, selection)``, as ``Registry.slice_rows``
    gives them) its entry files (v2 entries carry no selection), ``protocol``
    (``(namespace, key, value, policy)``) its protocol records' entry files."""
    manifest = manifest_for(metadata, measurement)
    files = []
    not_preloadable = 0
    for key, runner, tactic_json, policy_json, _selection in rows:
        text, preloadable = _entry_text(key, runner, tactic_json, policy_json)
        not_preloadable += not preloadable
        files.append((entry_file_name(key), text))
    n_protocol = 0
    for namespace, key, value_json, policy_json in protocol:
        n_protocol += 1
        text = _protocol_text(namespace, key, value_json, policy_json)
        files.append((entry_file_name(protocol_file_key(namespace, key)), text))
    files.sort()
    return StoreExport(
        tuple(sorted(manifest.items())),
        env_hash(manifest),
        tuple(files),
        not_preloadable,
        n_protocol,
    )


def _check_writable_root(root: Path) -> None:
    if root.exists() and not root.is_dir():
        raise V2StoreError(f"{root} is not a directory; give a FlashInfer v2 store root")
    if is_environment_dir(root):
        raise V2StoreError(
            f"{root} is an environment directory; give the store root (the directory "
            f"holding {SCHEMA}/)"
        )
    if root.exists() and not is_store_root(root) and any(root.iterdir()):
        raise V2StoreError(
            f"{root} is not a FlashInfer v2 store (no {SCHEMA}/ directory) and not empty; "
            "give a store root, an empty directory or a new path"
        )


def _write_store(root: Path, export: StoreExport) -> ExportResult:
    env_dir = root / SCHEMA / export.env_hash
    manifest_path = env_dir / MANIFEST
    entries_dir = env_dir / ENTRIES
    try:
        _check_writable_root(root)
        if manifest_path.exists():
            try:
                existing = _read_json(manifest_path)
            except ValueError as exc:
                raise V2StoreError(f"{manifest_path}: {exc}; not touching it") from None
            if existing != dict(export.manifest):
                raise V2StoreError(
                    f"{manifest_path} differs from the manifest this export writes; not touching it"
                )
        entries_dir.mkdir(parents=True, exist_ok=True)
        if not manifest_path.exists():
            publish(manifest_path, export.manifest_text)
        written = unchanged = 0
        for name, text in export.files:
            path = entries_dir / name
            data = text.encode()
            try:
                same = path.is_file() and path.read_bytes() == data
            except OSError:
                same = False
            if same:
                unchanged += 1
                continue
            publish(path, text)
            written += 1
    except OSError as exc:
        raise V2StoreError(
            f"cannot write {exc.filename or env_dir}: {exc.strerror}; files written so far "
            "are complete, run the export again"
        ) from None
    return ExportResult(env_dir, written, unchanged)
