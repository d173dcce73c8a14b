"""What a path given to ``import``, ``merge`` or ``--from-vllm`` is, and reading what it holds.

Owns recognising a source: ``recognise(spec)`` is the one place that says
what a path or URL names (another registry, a bundle, a FlashInfer v2 store
root or environment directory, a directory holding vLLM's autotune caches,
another directory, or a FlashInfer cache file), and ``import_kind(paths)``
says which import a command's paths get. It also owns finding vLLM's caches
in a tree (``find_vllm_caches``: the deployment directories and v2 stores
that ``ficache.adopt`` adopts; the layouts are described there) and what to
tell a user who gave ``import`` a directory that is no v2 store
(``import_hint``).
``read_files``, ``read_bundles`` and ``read_stores`` return an import's
parsed inputs; ``merge.open_source`` reads a merge's sources by the same
``recognise``. What a parsed FlashInfer file holds becomes entries and
records in one place, for an import (``importing.file_inputs``) and a merge
alike: ``file_fingerprint`` (its environment) and ``file_results``. It does not own the formats (``flashinfer_format``,
``bundle``, ``v2_store``), planning (``importing``, ``merge``) or writing.

Invariants:
- Recognising reads at most a file's first bytes and never raises: a path
  that cannot be looked up or read is a FlashInfer file, whose reading then
  says in one line why it cannot be read.
- A directory is never a file: it is a v2 store (its root, with ``v2/``, or
  one environment directory, with ``manifest.json``), a vLLM tree (vLLM's
  caches are found in it as an adoption finds them) or another directory;
  reading either of the last two as a store refuses it, saying what to give
  instead (``import_hint``: vLLM's caches suggest ``--from-vllm``).
- Finding vLLM's caches reads directory listings only, to a fixed depth
  (never a walk), follows no name it does not recognise, and never raises:
  a directory that cannot be listed is reported to the caller's ``skip``.
- One import takes one kind: v2 stores, bundles or FlashInfer files; a mix
  is a ``MixedSourcesError`` (the CLI's usage error) before anything is read.
- What is read is dated by ``tuned_time.tuned_at``, the one rule of every
  ingest path.
- A stream (``-`` for standard input, a pipe such as ``<(cat f.json)``,
  ``/dev/stdin``) is read exactly once (``spooled``), into a temporary file
  that recognising and reading then read as often as they need; its name
  stays the one given.
- A FlashInfer file's entries and records all take the fingerprint its
  ``_metadata`` names (or the one the user gave, for a file without), one
  scope, and the file's modification time (``file_results``).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import stat
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NamedTuple

from ficache import schema, tuned_time
from ficache._gcpause import paused_gc
from ficache.bundle import Bundle, looks_like_bundle, read_bundle
from ficache.errors import FingerprintError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import (
    MAX_FILE_BYTES,
    CacheFile,
    parse_cache_bytes,
    read_cache_bytes,
)
from ficache.records import records_of_file
from ficache.scopes import SHARED_SCOPE
from ficache.v2_store import (
    SCHEMA,
    StoreContents,
    is_environment_dir,
    is_store_root,
    read_store,
)
from ficache.values import NewEntry, NewRecord

REGISTRY = "registry"  # a SQLAlchemy URL, or a SQLite file
BUNDLE = "bundle"
V2_STORE = "v2 store"  # a store root or one environment directory
VLLM_TREE = "vllm tree"  # a directory holding vLLM's autotune caches (``--from-vllm``)
DIRECTORY = "directory"  # any other directory
#: The kinds that are directories: none is a file, none is a merge source.
DIRECTORY_KINDS = (V2_STORE, VLLM_TREE, DIRECTORY)
FLASHINFER = "flashinfer"  # any other file: reading it decides

_HEAD_BYTES = 64  # enough for the SQLite and the bundle magic


class MixedSourcesError(ValueError):
    """One import given paths of different kinds (the CLI reports a usage error)."""


def recognise(spec: str | os.PathLike[str]) -> str:
    """What ``spec`` names: ``REGISTRY``, ``BUNDLE``, ``V2_STORE``, ``DIRECTORY`` or ``FLASHINFER``."""
    text = os.fspath(spec)
    if "://" in text:
        return REGISTRY
    path = Path(text)
    if _is_dir(path):
        if is_store_root(path) or is_environment_dir(path):
            return V2_STORE
        return VLLM_TREE if holds_vllm_caches(path) else DIRECTORY
    try:
        with path.open("rb") as handle:
            head = handle.read(_HEAD_BYTES)
    except (OSError, ValueError):
        return FLASHINFER
    if head.startswith(schema.SQLITE_MAGIC):
        return REGISTRY
    if looks_like_bundle(head):
        return BUNDLE
    return FLASHINFER


def import_kind(paths: Sequence[str | os.PathLike[str]]) -> str:
    """The one import ``paths`` get: ``V2_STORE``, ``BUNDLE`` or ``FLASHINFER``.

    Any directory makes it an import of v2 stores (every path must then be a
    directory); else any bundle one of bundles (every path a bundle); else
    of FlashInfer files (a registry given to ``import`` is read as one, and
    refused as not JSON). A mix raises ``MixedSourcesError``.
    """
    kinds = [recognise(p) for p in paths]
    if any(k in DIRECTORY_KINDS for k in kinds):
        if not all(k in DIRECTORY_KINDS for k in kinds):
            raise MixedSourcesError("import v2 store directories and files in separate commands")
        return V2_STORE
    if BUNDLE in kinds:
        if not all(k == BUNDLE for k in kinds):
            raise MixedSourcesError(
                "import bundles and FlashInfer cache files in separate commands"
            )
        return BUNDLE
    return FLASHINFER


def read_files(
    paths: Iterable[Path], names: Mapping[str, str] | None = None
) -> list[tuple[str, CacheFile, Path]]:
    """``(name, parsed file, path)`` of each FlashInfer file, in order (the path dates it).

    ``names``: the name to give a path in place of its own (``Spooled.names``).
    """
    out = []
    for p in paths:
        name = names.get(str(p), str(p)) if names else str(p)
        out.append((name, parse_cache_bytes(read_cache_bytes(p), source=name), p))
    return out


#: The path that names standard input.
STDIN = "-"


class Spooled(NamedTuple):
    """An import's paths, each readable as often as needed (``spooled``)."""

    paths: tuple[Path, ...]
    #: A spooled path (as text) -> the name it was given ("-", "/dev/fd/63").
    names: dict[str, str]


def is_stream(path: Path) -> bool:
    """Whether ``path`` is ``-`` or neither a regular file nor a directory (a pipe, a
    terminal, ``/dev/stdin``): something that can be read only once."""
    if str(path) == STDIN:
        return True
    try:
        mode = path.stat().st_mode
    except (OSError, ValueError):
        return False  # reading it says why
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


@contextlib.contextmanager
def spooled(paths: Sequence[Path]) -> Iterator[Spooled]:
    """``paths`` with each stream (``is_stream``) read once into a temporary file,
    removed on exit; other paths unchanged.

    A stream is copied up to one byte past ``MAX_FILE_BYTES``, so its reading
    refuses an oversized one as it refuses a file, and a stream that cannot be
    read is left as given, so reading it reports why.
    """
    if not any(is_stream(p) for p in paths):
        yield Spooled(tuple(paths), {})
        return
    with tempfile.TemporaryDirectory(prefix="ficache-import-") as tmp:
        out: list[Path] = []
        names: dict[str, str] = {}
        for number, p in enumerate(paths):
            if not is_stream(p):
                out.append(p)
                continue
            copy = Path(tmp) / f"{number}.input"
            try:
                _copy_stream(p, copy)
            except OSError:
                out.append(p)
                continue
            out.append(copy)
            names[str(copy)] = "<stdin>" if str(p) == STDIN else str(p)
        yield Spooled(tuple(out), names)


def _copy_stream(path: Path, to: Path) -> None:
    """Copy the stream ``path`` (``-``: standard input) into ``to``, at most one byte
    past ``MAX_FILE_BYTES``."""
    with contextlib.ExitStack() as stack:
        stdin = str(path) == STDIN
        source = sys.stdin.buffer if stdin else stack.enter_context(path.open("rb"))
        target = stack.enter_context(to.open("wb"))
        left = MAX_FILE_BYTES + 1
        while left > 0:
            chunk = source.read(min(left, 1 << 20))
            if not chunk:
                break
            target.write(chunk)
            left -= len(chunk)


#: What a FlashInfer file without ``_metadata`` is told to do (``file_fingerprint``):
#: ``import`` takes ``--fingerprint``; ``merge`` does not, so it points to ``import``.
IMPORT_FINGERPRINT_ADVICE = "import it with --fingerprint ID|current"
MERGE_FINGERPRINT_ADVICE = "import it with `ficache import --fingerprint ID|current` instead"


def file_fingerprint(
    name: str,
    cache: CacheFile,
    given: Fingerprint | None = None,
    *,
    advice: str = IMPORT_FINGERPRINT_ADVICE,
) -> Fingerprint:
    """The environment of the parsed FlashInfer file ``name``: its ``_metadata``'s, else ``given``.

    A file without ``_metadata`` and no ``given`` is a ``FingerprintError``
    ending in ``advice``; a ``_metadata`` that names no fingerprint raises
    ``Fingerprint.from_flashinfer_metadata``'s ``FingerprintError``.
    """
    if cache.metadata is not None:
        return Fingerprint.from_flashinfer_metadata(cache.metadata)
    if given is not None:
        return given
    raise FingerprintError(f"{name} has no _metadata, so its environment is unknown; {advice}")


class FileResults(NamedTuple):
    """What one FlashInfer file holds, as a registry stores it."""

    entries: tuple[NewEntry, ...]
    records: tuple[NewRecord, ...]


def file_results(
    cache: CacheFile,
    fingerprint: Fingerprint,
    *,
    scope: str = SHARED_SCOPE,
    path: str | os.PathLike[str] | None = None,
) -> FileResults:
    """The entries and namespaced records of a parsed FlashInfer file, every one under
    ``fingerprint`` and ``scope``, dated by ``path``'s mtime (``tuned_time.tuned_at``:
    a FlashInfer file does not say when each entry was tuned; no path: now)."""
    at = tuned_time.tuned_at(None, path)
    make = tuple.__new__
    # A FileEntry is (key, runner, tactic, policy, fields, selection). One tuple per
    # entry and no cycles: the collector would only walk the heap (torch's too).
    with paused_gc():
        entries = tuple(
            [
                make(NewEntry, (fingerprint, key, runner, tactic, policy, scope, kf, at, selection))
                for key, runner, tactic, policy, kf, selection in cache.entries
            ]
        )
    records = (
        tuple(records_of_file(fingerprint, cache.record_rows, scope, at))
        if cache.record_rows
        else ()
    )
    return FileResults(entries, records)


def read_bundles(paths: Sequence[Path]) -> list[tuple[str, Bundle]]:
    """``(name, verified bundle)`` of each bundle, in order."""
    return [(str(p), read_bundle(p)) for p in paths]


def read_stores(
    paths: Sequence[Path], *, hint: Callable[[Path], str] | None = None
) -> list[StoreContents]:
    """Each v2 store (root or environment directory), in order; another directory is
    refused, with ``hint(directory)`` (default ``import_hint``) saying what to give instead."""
    return [read_store(p, hint=hint or import_hint) for p in paths]


# --------------------------------------------------------------------------
# vLLM trees (the layouts: ``ficache.adopt``'s docstring).

#: The directory under ``VLLM_CACHE_ROOT`` that holds vLLM's autotune roots.
AUTOTUNE_DIR = "flashinfer_autotune_cache"
#: vLLM 0.27-0.31: one file per deployment, rank 0's, loaded by every rank.
SINGLE_FILE_NAME = "autotune_configs.json"
#: vLLM 0.32+: one file per rank (``flashinfer_autotune_filename(dp_rank, rank)``).
RANK_FILE_NAME = re.compile(r"autotune_configs_dp(\d{1,6})_rank(\d{1,6})\.json")
#: ``RANK_FILE_NAME`` as a report names it.
RANK_FILE_PATTERN = "autotune_configs_dp<D>_rank<R>.json"

#: Where a directory that cannot be listed is reported: ``skip(path, reason)``.
Skip = Callable[[Path, str], None]


@dataclass(frozen=True)
class VllmDeployment:
    """One vLLM deployment directory: its single file and its per-rank files."""

    directory: Path
    single: Path | None
    ranks: tuple[tuple[int, int, Path], ...]  # (dp, rank, path), sorted


def _ignore(path: Path, reason: str) -> None:
    pass


def _subdirs(path: Path, skip: Skip) -> list[Path]:
    try:
        return sorted(p for p in path.iterdir() if p.is_dir())
    except OSError as exc:
        skip(path, f"cannot list ({exc.strerror})")
        return []


def _autotune_roots(root: Path, skip: Skip) -> Iterator[Path]:
    """The root itself, and ``<root>/flashinfer_autotune_cache/<version>/<arch>``."""
    yield root
    base = root / AUTOTUNE_DIR
    if base.is_dir():
        for version in _subdirs(base, skip):
            yield from _subdirs(version, skip)


def _deployment(directory: Path, skip: Skip) -> VllmDeployment | None:
    try:
        names = sorted(p.name for p in directory.iterdir())
    except OSError as exc:
        skip(directory, f"cannot list ({exc.strerror})")
        return None
    single = directory / SINGLE_FILE_NAME if SINGLE_FILE_NAME in names else None
    ranks = []
    for name in names:
        m = RANK_FILE_NAME.fullmatch(name)
        if m is not None:
            ranks.append((int(m.group(1)), int(m.group(2)), directory / name))
    if single is None and not ranks:
        return None
    return VllmDeployment(directory, single, tuple(sorted(ranks)))


def _resolved(path: Path) -> Path:
    try:
        return path.resolve()
    except OSError:
        return path


def find_vllm_caches(
    roots: Sequence[Path], v2_roots: Sequence[Path] = (), skip: Skip = _ignore
) -> tuple[list[VllmDeployment], list[Path]]:
    """vLLM's deployment directories and v2 store roots under ``roots`` (each a vLLM cache
    root, an autotune root or a deployment directory) and ``v2_roots``, each once, by path."""
    deployments: dict[Path, VllmDeployment] = {}
    stores: dict[Path, Path] = {}
    for root in roots:
        if not _is_dir(root):
            continue
        for autotune_root in _autotune_roots(root, skip):
            if is_store_root(autotune_root):
                stores.setdefault(_resolved(autotune_root), autotune_root)
            for directory in (autotune_root, *_subdirs(autotune_root, skip)):
                if _resolved(directory) in deployments or directory.name == SCHEMA:
                    continue
                deployment = _deployment(directory, skip)
                if deployment is not None:
                    deployments[_resolved(directory)] = deployment
    for v2_root in v2_roots:
        if is_store_root(v2_root):
            stores.setdefault(_resolved(v2_root), v2_root)
    return (
        sorted(deployments.values(), key=lambda d: str(d.directory)),
        sorted(stores.values(), key=str),
    )


def holds_vllm_caches(directory: Path) -> bool:
    """Whether an adoption of ``directory`` (``--from-vllm DIR``) would find vLLM's caches."""
    deployments, stores = find_vllm_caches((directory,))
    return bool(deployments or stores)


def import_hint(directory: Path) -> str:
    """What to run for ``directory``, given to ``import`` but no v2 store: what it holds decides.

    vLLM's caches (found as an adoption finds them) suggest ``--from-vllm``;
    FlashInfer cache files in it, naming them (``DIR/*.json``); else both forms.
    """
    quoted = shlex.quote(str(directory))
    if holds_vllm_caches(directory):
        return f"it holds vLLM's autotune caches: adopt them with `ficache import --from-vllm {quoted}`"
    try:
        files = sum(1 for p in directory.glob("*.json") if p.is_file())
    except OSError:
        files = 0
    if files:
        return f"to import the {files} cache file(s) in it, name them: `ficache import {quoted}/*.json`"
    return (
        "it holds no cache file (*.json) and no vLLM autotune cache; give cache files "
        "(`ficache import DIR/*.json`) or vLLM's cache root (`ficache import --from-vllm DIR`)"
    )


def _is_dir(path: Path) -> bool:
    """``path.is_dir()``, False where the file system cannot look the name up (too long...)."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


__all__ = [
    "AUTOTUNE_DIR",
    "BUNDLE",
    "DIRECTORY",
    "DIRECTORY_KINDS",
    "IMPORT_FINGERPRINT_ADVICE",
    "MERGE_FINGERPRINT_ADVICE",
    "RANK_FILE_NAME",
    "RANK_FILE_PATTERN",
    "SINGLE_FILE_NAME",
    "VLLM_TREE",
    "FLASHINFER",
    "REGISTRY",
    "V2_STORE",
    "FileResults",
    "MixedSourcesError",
    "VllmDeployment",
    "file_fingerprint",
    "file_results",
    "find_vllm_caches",
    "holds_vllm_caches",
    "import_hint",
    "import_kind",
    "read_bundles",
    "read_files",
    "STDIN",
    "Spooled",
    "is_stream",
    "spooled",
    "read_stores",
    "recognise",
]
