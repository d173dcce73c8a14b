"""Adopting what vLLM already tuned: its FlashInfer autotune files and its v2 store.

Installing ficache must never cost a server a re-tune it had already paid
for. SGLang's files are a second source (``Sources(..., engine="sglang")``):
``ficache.sglang_cache`` describes where they are and how they group into
layouts, and hands each group to ``adopt_rank_group``, the per-rank rule
below; everything else here (reading, skipping, the commit, the startup
adoption) is shared. ``plan_adoption`` finds vLLM's own autotune caches and turns them into
registry entries; ``AdoptionPlan.execute`` stores them as one commit of kind
``import``. ``ficache import --from-vllm [ROOT]`` and the vLLM plugin (once,
on a start whose registry holds nothing for its fingerprint:
``adopt_into_empty_registry``) both use it.

Layouts vLLM writes (every version from 0.27 to 0.33). A vLLM *autotune
root* is ``$VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR`` when set, else
``$VLLM_CACHE_ROOT/flashinfer_autotune_cache/<FlashInfer version>/<arch>``
(the last two parts are the names of FlashInfer's JIT workspace directory,
``~/.cache/flashinfer/<version>/<arch>``). Under it, one *deployment
directory* per vLLM configuration, named by the config hash: the sha256 of
``str(aot_compile_hash_factors(vllm_config))`` in the first releases, of
``vllm_config.compute_hash(include_version=False)`` later. The hash ignores
the data-parallel rank, so every rank of one deployment writes into one
directory. In it:

- single file (vLLM 0.27-0.31): ``autotune_configs.json``, FlashInfer's
  ``save_configs`` output of rank 0 (rank 0 tuned, or saved after
  synchronized tuning), broadcast to and loaded by every rank at the next
  start (vLLM PR #42537 added it; #42857 made rank 0 tune and broadcast).
- per rank (vLLM 0.32-0.33): ``autotune_configs_dp{D}_rank{R}.json``, each
  rank's own ``save_configs`` output, ``D`` the data-parallel rank and ``R``
  the rank in vLLM's world group (the change of vLLM PR #57635, "each rank
  saves and loads its own file"; ``flashinfer_autotune_filename`` in 0.33). vLLM
  ignores the single file from then on, so a directory may hold both.
- v2 store (vLLM 0.33, where its gates allow: one node, no pipeline
  parallelism, no elastic EP, one rank): FlashInfer's managed store
  (``ficache.v2_store``), rooted at ``$VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR``
  (so ``<that dir>/v2/<env hash>/...`` beside the deployment directories)
  or at FlashInfer's default root (``$FLASHINFER_AUTOTUNE_CACHE_DIR``, else
  ``$FLASHINFER_WORKSPACE_BASE`` or ``~``, then ``.cache/flashinfer/autotune``).

Recognising them. A root given to ``plan_adoption`` may be a vLLM cache
root (``flashinfer_autotune_cache`` under it is searched two levels deep
for autotune roots), an autotune root, or a deployment directory; every
one is also tried as the others, so any of the three works. A deployment
directory is a directory directly under an autotune root (or the root
itself) holding a file named as above; ranks and data-parallel ranks come
from the file names, nothing else. A v2 store is an autotune root (or a
``v2_roots`` entry) holding ``v2/``. Nothing else under a root is read:
the search is a fixed depth, never a walk, and follows no name it does not
recognise.

Shared or scoped. The files of one kind in one deployment directory are
one *layout group*:

- A single file is what every rank loaded: its entries are stored shared.
  (FlashInfer 0.7 keeps rank indices out of MoE keys so that ranks share
  entries; files from FlashInfer releases whose keys held rank indices are
  stored under their own fingerprint, which never serves a newer one.)
- Per-rank files: an entry whose (runner, tactic, policy) and fingerprint
  are equal in every rank's file is stored shared (with the lowest rank's
  selection: each rank times its own, so selections never count); every other entry (a
  tactic that differs, a key only some ranks hold) is stored once per file
  that holds it, scoped to ``<layout>/rank<N>`` (``registry.rank_scope``).
  A file of the group that cannot be read counts as a rank holding nothing,
  so then nothing of the group is shared (as vLLM, which loads per-rank
  files only when every rank has a matching one).
- The layout is what the vLLM plugin names at startup,
  ``tp{T}-pp{P}-dp{D}-ep{E}``, and the scope's rank is the rank in the
  plugin's tuning group. File names cannot tell tensor from pipeline
  parallelism or expert parallelism, so unless the caller knows better
  (``KnownLayout``: the plugin knows its own deployment directory, layout
  and tuning-group size; the CLI's ``--layout``), a group is named
  ``tp{T}-pp1-dp{D}-ep1`` with ``D`` = the largest data-parallel rank + 1
  and ``T`` = the most files of one data-parallel rank, and the scope's rank
  is the file's rank (vLLM's world rank, which is the plugin's tuning-group
  rank when there is no pipeline parallelism). With a ``KnownLayout`` the
  scope's rank is the file's rank modulo the tuning-group size (vLLM orders
  ranks tensor-parallel innermost).
- A v2 store is one store every rank reads: its entries are stored shared,
  each environment under the fingerprint of its manifest, measurement
  policy included (``Fingerprint.measurement``): environments that differ
  only in their policy are stored apart, none over another.

Namespaced records. The ``_records`` of vLLM's files (FlashInfer's
namespaced records, ``ficache.records``) are adopted like entries, by the
same rules: a single file's are stored shared; in per-rank files a record
(namespace, key) whose value and fingerprint are equal in every rank's file
is stored shared, every other one once per file that holds it, scoped to
its rank; later caches win in the same order, conflicts counted
(``record_conflicts``). A v2 store's protocol records (entries keyed
``('__protocol__', namespace, key)``, FlashInfer 0.7.4+) are adopted as
protocol records (``ficache.protocol_records``), a kind of their own and
never namespaced records: FlashInfer keeps them apart from ``_records``
(``get_protocol_records``, not ``get_namespaced_records``), so they are
stored shared with their entry file's measurement policy and exported only
to v2 stores (``export --v2-store``), never into a file's ``_records``. A
later store wins (``protocol_conflicts`` counts the values it replaced);
``ignored_records`` is kept in the plan and provenance, always 0.

Invariants:
- Reading never evaluates anything and never writes: files are parsed by
  ``flashinfer_format`` and ``v2_store`` (keys are data), no directory is
  created, no file under a root is changed. vLLM's cache dir stays as it was.
- Bad input never stops an adoption: an unreadable, malformed, hostile or
  metadata-less file, entry or environment is skipped and counted (the first
  ``MAX_REASONS`` with their reasons), and its group loses only what that
  rule says. ``plan_adoption`` never raises for what it finds (this path
  also runs inside server startup); only ``sources_at`` refuses a root the
  user named that is not a directory.
- One adoption is one commit (kind ``import``), entries and records
  together, whose provenance names every file, layout and v2 environment it
  read and what it skipped; adopting the same tree again adds nothing and
  makes no commit. It is written as an import of one input
  (``AdoptionPlan.import_plan``), the plan its preview (``--dry-run``)
  counts, so a dry run shows exactly what the run does; the commit's
  message and provenance are built by ``ficache.ingest_commit``. The v2
  environments are recorded by ``v2_store.environments_provenance``, the
  shape an import of the store records, so ``export --v2-store`` writes
  them back under their own measurement policy (the same ``env_hash``).
- Several caches may hold one (fingerprint, scope, key), or one
  (fingerprint, scope, namespace, record key): the later one wins, in this
  order: single files, then per-rank files, then v2 stores (vLLM's own order
  of versions), each by path; each such conflict with a different value is
  counted.
- ``tuned_at`` of an adopted entry or record is the modification time of the
  file that holds it (the earliest of them for a shared one), by the rule of
  every ingest path (``tuned_time.tuned_at``): vLLM saves a file right after
  the tuning that produced it.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ficache import schema, sqlite_fast, tuned_time
from ficache.deadline import DEFAULT_REGISTRY_TIMEOUT_S, registry_deadline
from ficache.errors import CacheFileError, FingerprintError, V2StoreError, VllmCacheError
from ficache.fingerprint import ALL_FIELDS, Fingerprint
from ficache.flashinfer_format import read_cache_file, unreadable_note
from ficache.ingest import (
    AUTOTUNE_DIR,
    RANK_FILE_PATTERN,
    SINGLE_FILE_NAME,
    VllmDeployment,
    find_vllm_caches,
)
from ficache.ingest import import_hint as import_hint  # re-exported: its old home
from ficache.ingest_commit import IngestSources
from ficache.models import SHARED_SCOPE
from ficache.protocol_records import NewProtocolRecord
from ficache.records import NewRecord
from ficache.registry import NewEntry, Registry, WriteResult, rank_scope
from ficache.retrying import retry_transient
from ficache.v2_store import (
    SCHEMA,
    Skipped,
    StoredEnvironment,
    environments_provenance,
    read_store,
)

if TYPE_CHECKING:
    from ficache.importing import ImportPlan

#: ``source`` of the provenance an adoption commit records.
PROVENANCE_SOURCE = "vllm-cache"
#: Skipped items kept with their reasons (all are counted).
MAX_REASONS = 20

SINGLE_FILE = "single file"
PER_RANK = "per rank"
V2_STORE = "v2 store"

#: The engines whose caches an adoption reads (``Sources.engine``).
VLLM = "vllm"
SGLANG = "sglang"
ENGINE_NAMES = {VLLM: "vLLM", SGLANG: "SGLang"}
#: ``source`` of an adoption commit's provenance, per engine.
PROVENANCE_SOURCES = {VLLM: PROVENANCE_SOURCE, SGLANG: "sglang-cache"}


# --------------------------------------------------------------------------
# Where to look.


@dataclass(frozen=True)
class Sources:
    """Where an adoption looks: roots (see the module docstring) and extra v2 store roots."""

    roots: tuple[Path, ...]
    v2_roots: tuple[Path, ...] = ()
    #: Whose caches: ``VLLM`` (this module's layouts) or ``SGLANG`` (``ficache.sglang_cache``).
    engine: str = "vllm"

    @property
    def display(self) -> str:
        return ", ".join(str(p) for p in (*self.roots, *self.v2_roots))

    @property
    def engine_name(self) -> str:
        return ENGINE_NAMES.get(self.engine, self.engine)

    @property
    def searched_str(self) -> str:
        """Where an adoption looks and for what, in one line (for "found nothing")."""

        def named(paths: Sequence[Path]) -> str:
            return ", ".join(f"{p}{'' if p.is_dir() else ' (missing)'}" for p in paths)

        if self.engine == SGLANG:
            from ficache import sglang_cache

            return sglang_cache.searched(named(self.roots))
        text = (
            f"looked for {SINGLE_FILE_NAME} (vLLM 0.27-0.31) and {RANK_FILE_PATTERN} "
            f"(vLLM 0.32+) in ROOT, ROOT/* and ROOT/{AUTOTUNE_DIR}/<version>/<arch>[/*], "
            f"and for a FlashInfer v2 store ({SCHEMA}/) in those; ROOT: {named(self.roots)}"
        )
        if self.v2_roots:
            text += f"; and for a v2 store in {named(self.v2_roots)}"
        return text


def default_vllm_cache_root(environ: Mapping[str, str] | None = None) -> Path:
    """``VLLM_CACHE_ROOT`` as vLLM resolves it: the variable, else ``$XDG_CACHE_HOME/vllm``."""
    env = os.environ if environ is None else environ
    explicit = env.get("VLLM_CACHE_ROOT")
    if explicit:
        return Path(explicit).expanduser()
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base).expanduser() / "vllm"


def default_flashinfer_v2_root(environ: Mapping[str, str] | None = None) -> Path:
    """FlashInfer's default managed-store root, computed without importing FlashInfer.

    ``flashinfer.autotune_cache.get_default_cache_root``:
    ``FLASHINFER_AUTOTUNE_CACHE_DIR``, else FlashInfer's cache dir
    (``$FLASHINFER_WORKSPACE_BASE`` or ``~``, then ``.cache/flashinfer``) ``/autotune``.
    """
    env = os.environ if environ is None else environ
    explicit = env.get("FLASHINFER_AUTOTUNE_CACHE_DIR")
    if explicit:
        return Path(explicit)
    base = env.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    return Path(base) / ".cache" / "flashinfer" / "autotune"


def default_sources(environ: Mapping[str, str] | None = None) -> Sources:
    """Where this vLLM installation keeps its autotune caches.

    ``VLLM_CACHE_ROOT`` (or vLLM's default), ``VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR``
    when set (per-rank files and, in 0.33, the v2 store), and FlashInfer's
    default v2 store root (vLLM 0.33's store when that variable is unset).
    """
    env = os.environ if environ is None else environ
    roots = [default_vllm_cache_root(env)]
    override = env.get("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR")
    if override:
        roots.append(Path(override).expanduser())
    return Sources(tuple(roots), (default_flashinfer_v2_root(env),))


def sglang_sources(environ: Mapping[str, str] | None = None) -> Sources:
    """Where this SGLang installation keeps its autotune files (``ficache.sglang_cache``)."""
    from ficache import sglang_cache

    return Sources((sglang_cache.default_root(environ),), engine=SGLANG)


#: What to give as ROOT, per engine (the tail of ``sources_at``'s error).
_ROOT_HINTS = {
    VLLM: "give vLLM's cache root (VLLM_CACHE_ROOT, default ~/.cache/vllm) "
    "or its VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
    SGLANG: "give SGLang's cache dir (SGLANG_CACHE_DIR, default ~/.cache/sglang)",
}


def sources_at(root: str | os.PathLike[str], engine: str = VLLM) -> Sources:
    """One root the user named; ``VllmCacheError`` when it is not a directory."""
    hint = _ROOT_HINTS[engine]
    try:
        path = Path(root).expanduser()
    except RuntimeError:  # ~user of a user without a home directory
        raise VllmCacheError(
            f"cannot find the home directory in {os.fspath(root)!r}; {hint}"
        ) from None
    if not path.is_dir():
        what = "does not exist" if not path.exists() else "is not a directory"
        raise VllmCacheError(f"{path} {what}; {hint}")
    return Sources((path,), engine=engine)


@dataclass(frozen=True)
class KnownLayout:
    """What the caller knows about one deployment directory (the plugin knows its own).

    Files in ``directory`` are scoped to ``layout``, rank ``file rank %
    group_size`` (``group_size``: the ranks of the plugin's tuning group).
    ``directory=None`` applies it to every per-rank directory (the CLI's
    ``--layout``; ``group_size=None`` keeps the file's rank).
    """

    directory: Path | None
    layout: str
    group_size: int | None = None

    def applies_to(self, directory: Path) -> bool:
        return self.directory is None or _same_dir(self.directory, directory)


def _same_dir(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve()
    except OSError:
        return a == b


# --------------------------------------------------------------------------
# What an adoption found.


@dataclass(frozen=True)
class AdoptedLayout:
    """One layout group: the files of one kind in one deployment directory."""

    directory: Path
    kind: str  # SINGLE_FILE or PER_RANK
    layout: str  # the layout its scopes name; "shared" for a single file
    files: tuple[str, ...]  # file names, sorted (unreadable ones included)
    shared: int  # entries stored shared
    scoped: int  # rows stored scoped to one rank
    skipped: int  # files that could not be read
    records_shared: int = 0  # namespaced records stored shared
    records_scoped: int = 0  # record rows stored scoped to one rank

    def as_json(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "kind": self.kind,
            "layout": self.layout,
            "files": list(self.files),
            "shared": self.shared,
            "scoped": self.scoped,
            "skipped": self.skipped,
            "records_shared": self.records_shared,
            "records_scoped": self.records_scoped,
        }


#: One v2 store environment an adoption read (``v2_store.StoredEnvironment``: its
#: ``as_json`` is what the commit records, so ``export --v2-store`` finds its policy).
AdoptedStore = StoredEnvironment


@dataclass(frozen=True)
class AdoptionPlan:
    """What an adoption would store; ``execute`` stores it as one commit."""

    sources: Sources
    layouts: tuple[AdoptedLayout, ...]
    stores: tuple[AdoptedStore, ...]
    skipped: tuple[Skipped, ...]  # the first MAX_REASONS, with reasons
    skipped_count: int  # files, entries and environments left out
    conflicts: int  # (fingerprint, scope, key) held with different values by two caches
    ignored_records: int  # v2 protocol records (see the module docstring)
    entries: tuple[NewEntry, ...] = field(repr=False)
    records: tuple[NewRecord, ...] = field(default=(), repr=False)
    record_conflicts: int = 0  # records held with different values by two caches
    #: The v2 stores' protocol records, stored shared (see the module docstring).
    protocol_records: tuple[NewProtocolRecord, ...] = field(default=(), repr=False)
    protocol_conflicts: int = 0  # protocol records held with different values by two stores

    @property
    def is_empty(self) -> bool:
        return not self.entries and not self.records and not self.protocol_records

    @property
    def files(self) -> int:
        """Files read: vLLM's JSON files and the v2 stores' entry files."""
        return sum(len(g.files) for g in self.layouts) + sum(s.files for s in self.stores)

    @property
    def shared(self) -> int:
        return sum(e.scope == SHARED_SCOPE for e in self.entries)

    @property
    def scoped(self) -> int:
        return len(self.entries) - self.shared

    @property
    def records_shared(self) -> int:
        return sum(r.scope == SHARED_SCOPE for r in self.records)

    @property
    def records_scoped(self) -> int:
        return len(self.records) - self.records_shared

    def provenance(self) -> dict[str, Any]:
        provenance: dict[str, Any] = {
            "source": PROVENANCE_SOURCES.get(self.sources.engine, PROVENANCE_SOURCE),
            "roots": [str(p) for p in (*self.sources.roots, *self.sources.v2_roots)],
            "layouts": [g.as_json() for g in self.layouts],
            **environments_provenance(self.stores),
            "entries": len(self.entries),
            "shared": self.shared,
            "scoped": self.scoped,
            "conflicts": self.conflicts,
            "skipped_count": self.skipped_count,
            "records": len(self.records),
            "records_shared": self.records_shared,
            "records_scoped": self.records_scoped,
            "record_conflicts": self.record_conflicts,
            "ignored_records": self.ignored_records,
        }
        if self.protocol_records or self.protocol_conflicts:
            provenance["protocol_records"] = len(self.protocol_records)
            provenance["protocol_conflicts"] = self.protocol_conflicts
        if self.skipped:
            provenance["skipped"] = [{"path": s.path, "reason": s.reason} for s in self.skipped]
        return provenance

    def commit_sources(self, provenance: Mapping[str, Any] | None = None) -> IngestSources:
        """What the adoption's commit names: every root, and ``provenance`` (a server
        start's) then what was found (``provenance()``)."""
        roots = (*self.sources.roots, *self.sources.v2_roots)
        return IngestSources(
            tuple(str(p) for p in roots),
            f"adopted from {self.sources.engine_name}: ",
            {**dict(provenance or {}), **self.provenance()},
        )

    def import_plan(self) -> ImportPlan:
        """The adoption as an import of one input (``ficache.importing``): what ``preview``
        shows and ``execute`` writes, so a dry run shows exactly what the run does.

        The input holds every identity once (the adoption resolved its own
        conflicts, later caches winning), so the import adds no counts of its own.
        """
        from ficache.importing import ImportInput, plan_import

        adopted = ImportInput(
            self.sources.display,
            tuple(self.entries),
            tuple(self.records),
            tuple(self.protocol_records),
        )
        return plan_import([adopted])

    def execute(
        self, registry: Registry, *, provenance: Mapping[str, Any] | None = None
    ) -> WriteResult:
        """Store the entries and records as one ``import`` commit (``provenance`` is added),
        through ``import_plan``, the plan ``preview`` shows."""
        return self.import_plan().execute(registry, self.commit_sources(provenance))

    def preview(self, registry: Registry | None) -> WriteResult:
        """The counts ``execute`` would return on ``registry``'s current state; writes nothing.

        ``import_plan``'s preview; ``registry`` None: a registry that does not
        exist yet (everything is added).
        """
        return self.import_plan().preview(registry)


# --------------------------------------------------------------------------
# Finding and reading.


class _Collector:
    """Skipped items and conflicts, counted as the search goes."""

    def __init__(self) -> None:
        self.skipped: list[Skipped] = []
        self.skipped_count = 0
        self.conflicts = 0
        self.record_conflicts = 0
        self.ignored_records = 0
        #: The v2 stores' protocol records by (fingerprint, namespace, key): a later one wins.
        self.protocol: dict[tuple[Fingerprint, str, str], NewProtocolRecord] = {}
        self.protocol_conflicts = 0

    def add_protocol(self, record: NewProtocolRecord) -> None:
        ident = (record.fingerprint, record.namespace, record.key)
        before = self.protocol.get(ident)
        if before is not None and (before.value_json, before.policy_json) != (
            record.value_json,
            record.policy_json,
        ):
            self.protocol_conflicts += 1
        self.protocol[ident] = record

    def skip(self, path: Path | str, reason: str, count: int = 1) -> None:
        self.skipped_count += count
        if len(self.skipped) < MAX_REASONS:
            self.skipped.append(Skipped(str(path), reason))


def _find(sources: Sources, found: _Collector) -> tuple[list[VllmDeployment], list[Path]]:
    """vLLM's caches under ``sources``, found by ``ingest.find_vllm_caches``."""
    return find_vllm_caches(sources.roots, sources.v2_roots, found.skip)


@dataclass(frozen=True)
class _ReadFile:
    path: Path
    fingerprint: Fingerprint
    #: key -> (runner, tactic, policy, fields, selection); the value is the first three.
    values: dict[str, tuple[str, str, str | None, Any, str | None]]
    mtime: float
    records: dict[tuple[str, str], str] = field(default_factory=dict)  # (ns, key) -> value JSON


def _read(path: Path, found: _Collector, *, refuse_unknown: bool = False) -> _ReadFile | None:
    """One cache file, or None (skipped and counted). ``refuse_unknown``: a file whose
    ``_metadata`` says ``"unknown"`` for its FlashInfer version is refused (SGLang's
    rule, see ``ficache.sglang_cache``)."""
    try:
        cache = read_cache_file(path)
        if cache.metadata is None:
            raise CacheFileError(f"{path}: no _metadata, so its environment is unknown")
        if refuse_unknown and cache.metadata.get("flashinfer_version") == "unknown":
            raise CacheFileError(
                f'{path}: its _metadata says "unknown" for flashinfer_version, so the '
                "FlashInfer release its tactics were tuned with is not known; not adopted"
            )
        fingerprint = Fingerprint.from_flashinfer_metadata(cache.metadata)
        mtime = tuned_time.tuned_at(None, path)
    except (CacheFileError, FingerprintError) as exc:
        found.skip(path, str(exc).removeprefix(f"{path}: "))
        return None
    except OSError as exc:
        found.skip(path, f"cannot read ({exc.strerror})")
        return None
    if cache.unreadable_keys:
        n = len(cache.unreadable_keys)
        found.skip(path, f"{unreadable_note(cache.unreadable_keys)}", count=n)
    values = {
        e.key: (e.runner, e.tactic_json, e.policy_json, e.fields, e.selection_json)
        for e in cache.entries
    }
    records = {(ns, key): value for ns, key, value in cache.record_rows}
    return _ReadFile(path, fingerprint, values, mtime, records)


#: A layout as the vLLM plugin names it (``vllm_plugin.layout_of``): every size at least 1.
VLLM_LAYOUT = re.compile(r"tp([1-9]\d{0,5})-pp([1-9]\d{0,5})-dp([1-9]\d{0,5})-ep([1-9]\d{0,5})")


def check_vllm_layout(layout: str) -> str:
    """``layout`` when the vLLM plugin could name it so, else ``ValueError``.

    Entries scoped to any other name are never served: the plugin asks for
    the scopes of the layout it names (``tp{T}-pp{P}-dp{D}-ep{E}``).
    """
    if not VLLM_LAYOUT.fullmatch(layout):
        raise ValueError(
            f"{layout!r} is not a layout the vLLM plugin names; give it as "
            "tp<T>-pp<P>-dp<D>-ep<E>, sizes of at least 1 (tp4-pp1-dp1-ep4)"
        )
    return layout


def derived_layout(ranks: Sequence[tuple[int, int, Path]]) -> str:
    """``tp{T}-pp1-dp{D}-ep1`` for per-rank files (see the module docstring)."""
    per_dp: dict[int, int] = {}
    for dp, _rank, _path in ranks:
        per_dp[dp] = per_dp.get(dp, 0) + 1
    return f"tp{max(per_dp.values())}-pp1-dp{max(per_dp) + 1}-ep1"


_Value = tuple[str, str, str | None]


class _Entries:
    """The adopted entries, later sources winning; conflicts counted."""

    def __init__(self, found: _Collector) -> None:
        self.found = found
        self.rows: dict[tuple[Fingerprint, str, str], NewEntry] = {}

    def add(self, entry: NewEntry) -> None:
        ident = (entry.fingerprint, entry.scope, entry.key)
        old = self.rows.get(ident)
        if old is not None and (old.runner, old.tactic_json, old.policy_json) != (
            entry.runner,
            entry.tactic_json,
            entry.policy_json,
        ):
            self.found.conflicts += 1
        self.rows[ident] = entry

    def ordered(self) -> tuple[NewEntry, ...]:
        return tuple(
            sorted(self.rows.values(), key=lambda e: (e.fingerprint.digest, e.scope, e.key))
        )


class _Records:
    """The adopted namespaced records, later sources winning; conflicts counted."""

    def __init__(self, found: _Collector) -> None:
        self.found = found
        self.rows: dict[tuple[Fingerprint, str, str, str], NewRecord] = {}

    def add(self, record: NewRecord) -> None:
        old = self.rows.get(record.identity)
        if old is not None and old.value_json != record.value_json:
            self.found.record_conflicts += 1
        self.rows[record.identity] = record

    def ordered(self) -> tuple[NewRecord, ...]:
        return tuple(
            sorted(
                self.rows.values(),
                key=lambda r: (r.fingerprint.digest, r.scope, r.namespace, r.key),
            )
        )


def _adopt_single(
    deployment: VllmDeployment, entries: _Entries, records: _Records, found: _Collector
) -> AdoptedLayout:
    assert deployment.single is not None
    read = _read(deployment.single, found)
    if read is not None:
        for key, (runner, tactic, policy, fields, selection) in read.values.items():
            entries.add(
                NewEntry(
                    read.fingerprint,
                    key,
                    runner,
                    tactic,
                    policy,
                    SHARED_SCOPE,
                    fields,
                    read.mtime,
                    selection,
                )
            )
        for (ns, key), value in read.records.items():
            records.add(NewRecord(read.fingerprint, ns, key, value, SHARED_SCOPE, read.mtime))
    return AdoptedLayout(
        deployment.directory,
        SINGLE_FILE,
        SHARED_SCOPE,
        (SINGLE_FILE_NAME,),
        len(read.values) if read is not None else 0,
        0,
        int(read is None),
        len(read.records) if read is not None else 0,
        0,
    )


def _adopt_per_rank(
    deployment: VllmDeployment,
    entries: _Entries,
    records: _Records,
    found: _Collector,
    known: KnownLayout | None,
) -> AdoptedLayout:
    if known is not None and known.applies_to(deployment.directory):
        layout, group_size = known.layout, known.group_size
    else:
        layout, group_size = derived_layout(deployment.ranks), None
    ranked = [
        (rank % group_size if group_size else rank, path) for _dp, rank, path in deployment.ranks
    ]
    return adopt_rank_group(
        deployment.directory,
        PER_RANK,
        layout,
        ranked,
        tuple(sorted(path.name for _dp, _rank, path in deployment.ranks)),
        entries,
        records,
        found,
    )


def adopt_rank_group(
    directory: Path,
    kind: str,
    layout: str,
    ranked: Sequence[tuple[int, Path]],
    names: tuple[str, ...],
    entries: _Entries,
    records: _Records,
    found: _Collector,
    *,
    refuse_unknown: bool = False,
) -> AdoptedLayout:
    """One layout group of per-rank files: ``ranked`` is ``(rank in layout, path)``.

    The rule of every engine's per-rank files (module docstring, "Shared or
    scoped"): equal in every file of the group, shared; else once per file,
    scoped to ``rank_scope(layout, rank)``, the first file of a scope winning.
    """
    reads = [(rank, _read(path, found, refuse_unknown=refuse_unknown)) for rank, path in ranked]
    complete = all(read is not None for _rank, read in reads)
    present = [(rank, read) for rank, read in reads if read is not None]
    shared, scoped = _adopt_group_entries(present, complete, len(reads), layout, entries, found)
    records_shared, records_scoped = _adopt_group_records(
        present, complete, len(reads), layout, records, found
    )
    return AdoptedLayout(
        directory,
        kind,
        layout,
        names,
        shared,
        scoped,
        len(reads) - len(present),
        records_shared,
        records_scoped,
    )


def _adopt_group_entries(
    present: Sequence[tuple[int, _ReadFile]],
    complete: bool,
    group_size: int,
    layout: str,
    entries: _Entries,
    found: _Collector,
) -> tuple[int, int]:
    """The entries of one layout group's read files, by ``adopt_rank_group``'s rule.

    ``present`` are the files read of the group's ``group_size``; ``complete``:
    every one was read (nothing is shared otherwise). Returns the (shared,
    scoped) counts.
    """
    keys = sorted({key for _rank, read in present for key in read.values})
    shared = scoped = 0
    scoped_here: dict[tuple[Fingerprint, str, str], _Value] = {}
    for key in keys:
        holders = [(rank, read) for rank, read in present if key in read.values]
        values = {(read.fingerprint, read.values[key][:3]) for _rank, read in holders}
        if complete and len(holders) == group_size and len(values) == 1:
            _add_shared_entry(key, holders, entries)
            shared += 1
            continue
        scoped += _add_scoped_entries(key, holders, layout, scoped_here, entries, found)
    return shared, scoped


def _add_shared_entry(
    key: str, holders: Sequence[tuple[int, _ReadFile]], entries: _Entries
) -> None:
    """An entry equal on every rank; each rank timed it itself: the lowest rank's selection."""
    runner, tactic, policy, fields, selection = holders[0][1].values[key]
    tuned_at = min(read.mtime for _rank, read in holders)
    entries.add(
        NewEntry(
            holders[0][1].fingerprint,
            key,
            runner,
            tactic,
            policy,
            SHARED_SCOPE,
            fields,
            tuned_at,
            selection,
        )
    )


def _add_scoped_entries(
    key: str,
    holders: Sequence[tuple[int, _ReadFile]],
    layout: str,
    scoped_here: dict[tuple[Fingerprint, str, str], _Value],
    entries: _Entries,
    found: _Collector,
) -> int:
    """``key`` once per holding file, scoped to its rank; how many entries were added.

    Two files of one scope: the lower rank's file wins (``scoped_here`` holds
    the winners), a different value counted as a conflict.
    """
    added = 0
    for rank, read in holders:
        scope = rank_scope(layout, rank)
        runner, tactic, policy, fields, selection = read.values[key]
        ident = (read.fingerprint, scope, key)
        if ident in scoped_here:
            found.conflicts += scoped_here[ident] != (runner, tactic, policy)
            continue
        scoped_here[ident] = (runner, tactic, policy)
        entries.add(
            NewEntry(
                read.fingerprint,
                key,
                runner,
                tactic,
                policy,
                scope,
                fields,
                read.mtime,
                selection,
            )
        )
        added += 1
    return added


def _adopt_group_records(
    present: Sequence[tuple[int, _ReadFile]],
    complete: bool,
    group_size: int,
    layout: str,
    records: _Records,
    found: _Collector,
) -> tuple[int, int]:
    """The records of one layout group's read files, by the entries' rule.

    Equal in every rank's file, shared; else one per rank, the lower rank's
    file winning. Returns the (shared, scoped) counts.
    """
    record_ids = sorted({ident for _rank, read in present for ident in read.records})
    records_shared = records_scoped = 0
    record_scoped_here: dict[tuple[Fingerprint, str, str, str], str] = {}
    for ns, key in record_ids:
        holders = [(rank, read) for rank, read in present if (ns, key) in read.records]
        record_values = {(read.fingerprint, read.records[ns, key]) for _rank, read in holders}
        if complete and len(holders) == group_size and len(record_values) == 1:
            first = holders[0][1]
            tuned_at = min(read.mtime for _rank, read in holders)
            records.add(
                NewRecord(
                    first.fingerprint, ns, key, first.records[ns, key], SHARED_SCOPE, tuned_at
                )
            )
            records_shared += 1
            continue
        for rank, read in holders:
            record = NewRecord(
                read.fingerprint,
                ns,
                key,
                read.records[ns, key],
                rank_scope(layout, rank),
                read.mtime,
            )
            if record.identity in record_scoped_here:  # the lower rank's file wins
                found.record_conflicts += record_scoped_here[record.identity] != record.value_json
                continue
            record_scoped_here[record.identity] = record.value_json
            records.add(record)
            records_scoped += 1
    return records_shared, records_scoped


def _adopt_store(root: Path, entries: _Entries, found: _Collector) -> list[AdoptedStore]:
    try:
        contents = read_store(root)
    except V2StoreError as exc:
        found.skip(root, str(exc).removeprefix(f"{root}: "))
        return []
    for skipped in contents.skipped_environments:
        found.skip(skipped.path, skipped.reason)
    adopted = []
    for env in contents.environments:
        # Two measurement policies of one environment are two fingerprints
        # (``Fingerprint.measurement``): each adopted, never one over the other.
        found.skipped_count += env.skipped
        for skipped in env.first_skipped:
            if len(found.skipped) < MAX_REASONS:
                found.skipped.append(skipped)
        for p, mtime in env.protocol:
            found.add_protocol(
                NewProtocolRecord(
                    env.fingerprint,
                    p.namespace,
                    p.key,
                    p.value_json,
                    p.policy_json,
                    SHARED_SCOPE,
                    mtime,
                )
            )
        for e, mtime in zip(env.entries, env.tuned_at, strict=True):
            entries.add(
                NewEntry(
                    env.fingerprint,
                    e.key,
                    e.runner,
                    e.tactic_json,
                    e.policy_json,
                    SHARED_SCOPE,
                    e.fields,
                    mtime,
                )
            )
        adopted.append(StoredEnvironment.of(env))
    return adopted


def _sglang_known(known: KnownLayout | None) -> tuple[Path | None, str] | None:
    """A ``KnownLayout`` as ``sglang_cache.find_groups`` takes it (directory None: every one)."""
    return None if known is None else (known.directory, known.layout)


def plan_adoption(sources: Sources, *, known: KnownLayout | None = None) -> AdoptionPlan:
    """Find and read every autotune cache of ``sources.engine`` under ``sources``; write nothing.

    Never raises for what it finds: what cannot be read is skipped and counted.
    """
    found = _Collector()
    entries = _Entries(found)
    records = _Records(found)
    if sources.engine == SGLANG:
        from ficache import sglang_cache

        layouts = [
            adopt_rank_group(
                g.directory,
                g.kind,
                g.layout,
                g.ranked,
                g.names,
                entries,
                records,
                found,
                refuse_unknown=True,
            )
            for g in sglang_cache.find_groups(
                sources.roots,
                lambda path, reason: found.skip(path, reason),
                _sglang_known(known),
            )
        ]
        stores: list[AdoptedStore] = []
    else:
        deployments, store_roots = _find(sources, found)
        layouts = [
            _adopt_single(d, entries, records, found) for d in deployments if d.single is not None
        ]
        layouts += [
            _adopt_per_rank(d, entries, records, found, known) for d in deployments if d.ranks
        ]
        stores = [s for root in store_roots for s in _adopt_store(root, entries, found)]
    return AdoptionPlan(
        sources,
        tuple(layouts),
        tuple(stores),
        tuple(found.skipped),
        found.skipped_count,
        found.conflicts,
        found.ignored_records,
        entries.ordered(),
        records.ordered(),
        found.record_conflicts,
        tuple(found.protocol.values()),
        found.protocol_conflicts,
    )


# --------------------------------------------------------------------------
# At server startup.


def _db_text(db: str | os.PathLike[str] | None) -> str | None:
    return os.fspath(db) if db is not None else None


def registry_holds_entries_for(db: str | os.PathLike[str] | None, fingerprint: Fingerprint) -> bool:
    """True when a stored fingerprint that serves ``fingerprint`` has entries.

    A SQLite file is asked over one read-only connection (the warm start's
    own fast path opens no registry either); a missing file holds nothing.
    Anything else, or any doubt, goes through ``Registry.open``, which
    explains its problems (``FicacheError``).
    """
    location = schema.resolve(db)
    if location.path is not None:
        if not location.path.exists():
            return False
        try:
            rows = sqlite_fast.fingerprints_with_entries(location.path)
            return any(
                Fingerprint(
                    **dict(zip(ALL_FIELDS, row[:-1], strict=True)), measurement=row[-1]
                ).serves(fingerprint)
                for row in rows
            )
        except Exception:  # noqa: BLE001 - any doubt: the full path below explains itself
            pass
    with Registry.open(_db_text(db)) as reg:
        return any(info.entries for info in reg.serving(fingerprint))


@dataclass(frozen=True)
class StartupAdoption:
    """What ``adopt_into_empty_registry`` found and wrote."""

    plan: AdoptionPlan
    result: WriteResult


def adopt_into_empty_registry(
    db: str | os.PathLike[str] | None,
    fingerprint: Fingerprint,
    sources: Sources,
    *,
    known: KnownLayout | None = None,
    provenance: Mapping[str, Any] | None = None,
    busy_timeout: float = 5.0,
    registry_timeout: float | None = DEFAULT_REGISTRY_TIMEOUT_S,
) -> StartupAdoption | None:
    """Adopt ``sources`` when the registry holds nothing for ``fingerprint``.

    Returns None (having read no cache) when it holds something already.
    Opens the registry for writing only when there is something to adopt,
    and then waits at most ``busy_timeout`` seconds for a lock per attempt.
    The check and the write each wait at most ``registry_timeout`` seconds
    on a registry server that stopped answering (``ficache.deadline``;
    reading vLLM's files in between is not counted); within it, a server that
    refuses for now (too many clients, starting up, ...) is asked again
    (``ficache.retrying``), and a write retried after a lost connection
    first checks whether it landed. Raises
    ``FicacheError`` for a registry it cannot use; the caller (server
    startup) logs it and starts without adopting.
    """
    what = f"registry {schema.resolve(db).display}"
    with registry_deadline(registry_timeout, what):
        held = retry_transient(
            lambda: registry_holds_entries_for(db, fingerprint), within=registry_timeout
        )
    if held:
        return None
    plan = plan_adoption(sources, known=known)
    if plan.is_empty:
        return StartupAdoption(plan, WriteResult(None))

    def write() -> StartupAdoption:
        with Registry.open(_db_text(db)) as reg:
            schema.bound_busy_timeout(reg.engine, busy_timeout)
            return StartupAdoption(plan, plan.execute(reg, provenance=provenance))

    def landed() -> StartupAdoption | None:
        # A write whose connection was lost may have landed: then (or when another
        # server adopted meanwhile) the registry is no longer empty for the fingerprint.
        if registry_holds_entries_for(db, fingerprint):
            return StartupAdoption(plan, WriteResult(None))
        return None

    with registry_deadline(registry_timeout, what):
        return retry_transient(write, within=registry_timeout, before_retry=landed)
