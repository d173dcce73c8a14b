"""What one ``ficache import`` asks for, decided: which import it is, what it reads, what it refuses.

Owns the decisions of an import request (``ImportRequest``: the paths and
options of one ``import``): which options go together (``ImportUsageError``,
the CLI's usage error, before anything is read), which import the request
gets (``ImportRequest.kind``: an adoption of vLLM's or SGLang's caches, or,
by ``ingest.import_kind``, the one place that recognises a path, an import
of v2 stores, bundles or FlashInfer files), reading its inputs, and the
frozen ``PreparedImport`` whose ``preview(registry)`` is what ``--dry-run``
shows and ``execute(registry)`` the one commit (its message and provenance
built by ``ficache.ingest_commit`` from ``PreparedImport.sources``). An
adoption is found and planned by ``ficache.adopt`` (``prepare_adoption``
builds its sources), whose ``AdoptionPlan`` has the same two methods, both
through one import plan.

It does not own recognising a path (``ingest``), reconciling inputs
(``importing``), adopting (``adopt``), opening the registry or rendering
(``cli``).

Invariants:
- Every refusal of a combination of options is an ``ImportUsageError``
  raised before any input is read, except the two that depend on what was
  read: ``--fingerprint`` given for files that all name their environment,
  and a conflict under ``fail`` (``ImportPlan.check``, a ``MergeConflictError``).
- A FlashInfer file import whose fingerprint is none or ``current`` is
  planned, and refused, before the registry is opened
  (``FileImport.early_plan``); a stored fingerprint is looked up in the
  registry the import writes (``FileImport.plan_in``).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ficache import ingest
from ficache.adopt import (
    SGLANG,
    VLLM,
    AdoptionPlan,
    KnownLayout,
    check_vllm_layout,
    default_sources,
    plan_adoption,
    sglang_sources,
    sources_at,
)
from ficache.errors import NotFoundError
from ficache.flashinfer_format import CacheFile
from ficache.importing import (
    ImportPlan,
    bundle_sources,
    file_inputs,
    plan_bundle_import,
    plan_import,
    plan_store_import,
    store_sources,
)
from ficache.ingest_commit import IngestSources
from ficache.models import SHARED_SCOPE
from ficache.registry_access import RegistryAccess
from ficache.v2_store import Skipped, StoreContents, StoreEnvironment
from ficache.values import WriteResult

#: ``ImportRequest.kind`` of an adoption (``--from-vllm``/``--from-sglang``).
ADOPTION = "adoption"

#: What a request with ``--on-conflict`` and an adoption is told (an adoption's own rule).
_ADOPTION_KEEPS = (
    "keeps the later cache's value (v2 store over per-rank files over a single file; the "
    "newest SGLang run)"
)


class ImportUsageError(ValueError):
    """An ``import`` given options that do not go together (the CLI's usage error, exit 2).

    ``param_hint``: the one option whose value is invalid, where one is (the
    CLI's ``BadParameter``).
    """

    def __init__(self, message: str, param_hint: str | None = None) -> None:
        super().__init__(message)
        self.param_hint = param_hint


@dataclass(frozen=True)
class ImportRequest:
    """The paths and options of one ``import``, as given (``None``: an option not given).

    ``from_vllm``/``from_sglang``: the root to adopt from, ``""`` for the
    engine's default roots.
    """

    files: tuple[Path, ...] = ()
    fingerprint_ref: str | None = None
    scope: str = SHARED_SCOPE
    from_vllm: str | None = None
    from_sglang: str | None = None
    layout: str | None = None
    policy: str = "keep"
    #: A path of ``files`` (as text) -> the name it was given, where they differ
    #: (a stream read once into a temporary file: ``ingest.spooled``).
    names: tuple[tuple[str, str], ...] = ()

    @property
    def engine(self) -> str | None:
        """``"vllm"`` or ``"sglang"`` for an adoption, else None."""
        if self.from_vllm is not None:
            return "vllm"
        return "sglang" if self.from_sglang is not None else None

    @property
    def root(self) -> str | None:
        """The adoption's root (``""``: the engine's defaults), or None."""
        return self.from_vllm if self.from_vllm is not None else self.from_sglang

    def kind(self) -> str:
        """``ADOPTION``, or the import the paths get (``ingest.import_kind``).

        Raises ``ImportUsageError`` for options that do not go with that
        import; reads at most the paths' first bytes.
        """
        if self.from_vllm is not None and self.from_sglang is not None:
            raise ImportUsageError("give --from-vllm or --from-sglang, not both")
        if self.engine is not None:
            option = f"--from-{self.engine}"
            if self.files or self.fingerprint_ref is not None or self.scope != SHARED_SCOPE:
                raise ImportUsageError(f"{option} takes no FILES, --fingerprint or --scope")
            if self.policy != "keep":
                raise ImportUsageError(
                    f"--on-conflict goes with FILES, bundles or v2 stores; {option} "
                    + _ADOPTION_KEEPS
                )
            return ADOPTION
        if self.layout is not None:
            raise ImportUsageError("--layout goes with --from-vllm or --from-sglang")
        if not self.files:
            raise ImportUsageError("give FILES to import, or --from-vllm, or --from-sglang")
        try:
            kind = ingest.import_kind(self.files)
        except ingest.MixedSourcesError as exc:
            raise ImportUsageError(str(exc)) from None
        if kind == ingest.V2_STORE and self.fingerprint_ref is not None:
            raise ImportUsageError(
                "a v2 store's manifest names its environments; drop --fingerprint"
            )
        if kind == ingest.BUNDLE and (
            self.fingerprint_ref is not None or self.scope != SHARED_SCOPE
        ):
            raise ImportUsageError(
                "a bundle carries its own fingerprints and scopes; drop --fingerprint/--scope"
            )
        return kind


@dataclass(frozen=True)
class PreparedImport:
    """One planned import and the commit it makes: ``preview`` (``--dry-run``) or ``execute``."""

    plan: ImportPlan
    #: What the commit names (``ficache.ingest_commit``): the inputs, and what
    #: its provenance records of them.
    sources: IngestSources

    @property
    def message(self) -> str:
        """The commit's message: every input's name."""
        return self.sources.message

    def preview(self, registry: RegistryAccess | None) -> WriteResult:
        """The counts ``execute`` would return (``registry`` None: none exists yet); writes nothing."""
        return self.plan.preview(registry)

    def execute(self, registry: RegistryAccess) -> WriteResult:
        """The import, as one ``import`` commit (none when nothing changes)."""
        return self.plan.execute(registry, self.sources)


def prepare_adoption(request: ImportRequest) -> AdoptionPlan:
    """Find and read the caches an adoption request names (``ficache.adopt.plan_adoption``).

    ``request.layout`` (checked first: an ``ImportUsageError`` on
    ``--layout``) scopes per-rank files; ``request.root`` ``""``: the
    engine's default roots.
    """
    engine = request.engine or VLLM
    known = None
    if request.layout is not None:
        try:
            check_vllm_layout(request.layout)
        except ValueError as exc:
            raise ImportUsageError(str(exc), param_hint="'--layout'") from None
        known = KnownLayout(None, request.layout)
    if request.root:
        sources = sources_at(request.root, engine)
    else:
        sources = sglang_sources() if engine == SGLANG else default_sources()
    return plan_adoption(sources, known=known)


def prepare_bundle_import(request: ImportRequest) -> PreparedImport:
    """Read and verify every bundle of ``request``, and plan their import; refused under ``fail``."""
    bundles = ingest.read_bundles(request.files)
    plan = plan_bundle_import(bundles, request.policy)
    plan.check()
    return PreparedImport(plan, bundle_sources(bundles))


@dataclass(frozen=True)
class StoreImport:
    """An import of v2 stores: what was read (and skipped), and its ``PreparedImport``."""

    stores: tuple[StoreContents, ...]
    prepared: PreparedImport
    entries: int  # read (skipped ones not counted)
    skipped_entries: int  # malformed (FlashInfer treats them as misses)
    #: Protocol records read (stored as protocol records, shared).
    protocol_records: int

    @property
    def environments(self) -> list[StoreEnvironment]:
        """Every environment read, store by store."""
        return [env for store in self.stores for env in store.environments]

    @property
    def first_skipped_entry(self) -> Skipped | None:
        """What the first skipped entry was, or None."""
        return next((s for e in self.environments for s in e.first_skipped), None)

    @property
    def skipped_environments(self) -> list[Skipped]:
        """Each environment skipped for a malformed manifest."""
        return [skip for s in self.stores for skip in s.skipped_environments]


def prepare_store_import(request: ImportRequest) -> StoreImport:
    """Read every v2 store of ``request`` and plan their import; refused under ``fail``."""
    stores = tuple(ingest.read_stores(request.files))
    plan = plan_store_import(stores, scope=request.scope, policy=request.policy)
    plan.check()
    return StoreImport(
        stores,
        PreparedImport(plan, store_sources(stores)),
        sum(s.entries for s in stores),
        sum(s.skipped_entries for s in stores),
        sum(s.records for s in stores),
    )


@dataclass(frozen=True)
class FileImport:
    """An import of FlashInfer files, read; planned once its fingerprint is known.

    ``note``: the warning to print after the import, where ``--fingerprint``
    applied to some files only.
    """

    request: ImportRequest
    parsed: tuple[tuple[str, CacheFile, Path], ...] = field(repr=False)
    note: str | None = None

    @property
    def sources(self) -> IngestSources:
        """What the import commit names: every file's name."""
        return IngestSources(tuple(name for name, _, _ in self.parsed))

    @property
    def ignored_selections(self) -> int:
        """Entries whose fourth element is not an object (imported without a selection)."""
        return sum(c.ignored_selections for _, c, _ in self.parsed)

    @property
    def unreadable_keys(self) -> tuple[str, ...]:
        """Entries skipped for a key ficache cannot read, as ``'<key>': <why>``."""
        return tuple(p for _, c, _ in self.parsed for p in c.unreadable_keys)

    def plan(self, fingerprint: Any) -> PreparedImport:
        """The import, with ``fingerprint`` for the files without ``_metadata``."""
        inputs = file_inputs(
            [(name, cache) for name, cache, _ in self.parsed],
            fingerprint=fingerprint,
            scope=self.request.scope,
            paths=[path for _, _, path in self.parsed],
        )
        return PreparedImport(plan_import(inputs, self.request.policy), self.sources)

    def early_plan(self) -> PreparedImport | None:
        """The import planned (and refused under ``fail``) before the registry opens,
        or None where ``--fingerprint`` names a stored fingerprint."""
        ref = self.request.fingerprint_ref
        if ref not in (None, "current"):
            return None
        fingerprint = None
        if ref == "current":
            from ficache.fingerprint import collect

            fingerprint = collect()
        prepared = self.plan(fingerprint)
        prepared.plan.check()
        return prepared

    def plan_in(self, registry: Any, where: str) -> PreparedImport:
        """The import, with the stored fingerprint ``--fingerprint`` names in ``registry``
        (None: no registry at ``where``, a ``NotFoundError``)."""
        ref = str(self.request.fingerprint_ref)
        if registry is None:
            raise NotFoundError(
                f"no registry at {where}, so no fingerprint {ref!r}; see `ficache fingerprints`"
            )
        return self.plan(registry.fingerprint(ref).fingerprint)


def read_file_import(request: ImportRequest, files: Iterable[Path] | None = None) -> FileImport:
    """Read the FlashInfer files of ``request`` (``files``: the same paths, as the caller
    iterates them, a progress bar say); ``ImportUsageError`` where ``--fingerprint``
    is given and every file names its environment."""
    parsed = tuple(
        ingest.read_files(request.files if files is None else files, dict(request.names))
    )
    note = _fingerprint_note(parsed) if request.fingerprint_ref else None
    return FileImport(request, parsed, note)


def _fingerprint_note(parsed: Sequence[tuple[str, CacheFile, Path]]) -> str | None:
    """``import --fingerprint`` names the environment of files without ``_metadata``.

    Where every file names its own it would do nothing: a usage error. Where
    some do, the warning to print after the import says which keep theirs.
    """
    named = [source for source, cache, _ in parsed if cache.metadata is not None]
    if len(named) == len(parsed):
        which = named[0] if len(named) == 1 else "every file given"
        raise ImportUsageError(
            f"--fingerprint is for files without _metadata, and {which} has one naming its "
            "environment; drop --fingerprint"
        )
    if not named:
        return None
    return (
        f"warning: --fingerprint applied to {len(parsed) - len(named)} file(s) without "
        f"_metadata; {len(named)} file(s) with _metadata kept the fingerprint it names "
        f"(first: {named[0]})"
    )


__all__ = [
    "ADOPTION",
    "FileImport",
    "ImportRequest",
    "ImportUsageError",
    "PreparedImport",
    "StoreImport",
    "prepare_adoption",
    "prepare_bundle_import",
    "prepare_store_import",
    "read_file_import",
]
