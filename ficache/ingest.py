"""What a path given to ``import`` or ``merge`` is, and reading what it holds.

Owns recognising a source: ``recognise(spec)`` is the one place that says
what a path or URL names (another registry, a bundle, a FlashInfer v2 store
root or environment directory, another directory, or a FlashInfer cache
file), and ``import_kind(paths)`` says which import a command's paths get.
``read_files``, ``read_bundles`` and ``read_stores`` return an import's
parsed inputs; ``merge.open_source`` reads a merge's sources by the same
``recognise``. It does not own the formats (``flashinfer_format``,
``bundle``, ``v2_store``), planning (``importing``, ``merge``) or writing.

Invariants:
- Recognising reads at most a file's first bytes and never raises: a path
  that cannot be looked up or read is a FlashInfer file, whose reading then
  says in one line why it cannot be read.
- A directory is never a file: it is a v2 store (its root, with ``v2/``, or
  one environment directory, with ``manifest.json``) or another directory,
  which reading as a store refuses, saying what to give instead
  (the caller's hint, ``adopt.import_hint`` from the CLI: vLLM's caches suggest
  ``--from-vllm``).
- One import takes one kind: v2 stores, bundles or FlashInfer files; a mix
  is a ``MixedSourcesError`` (the CLI's usage error) before anything is read.
- What is read is dated by ``tuned_time.tuned_at``, the one rule of every
  ingest path.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from ficache import schema
from ficache.bundle import Bundle, looks_like_bundle, read_bundle
from ficache.flashinfer_format import CacheFile, read_cache_file
from ficache.v2_store import StoreContents, is_environment_dir, is_store_root, read_store

REGISTRY = "registry"  # a SQLAlchemy URL, or a SQLite file
BUNDLE = "bundle"
V2_STORE = "v2 store"  # a store root or one environment directory
DIRECTORY = "directory"  # any other directory
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
        return V2_STORE if is_store_root(path) or is_environment_dir(path) else DIRECTORY
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
    if any(k in (V2_STORE, DIRECTORY) for k in kinds):
        if not all(k in (V2_STORE, DIRECTORY) for k in kinds):
            raise MixedSourcesError("import v2 store directories and files in separate commands")
        return V2_STORE
    if BUNDLE in kinds:
        if not all(k == BUNDLE for k in kinds):
            raise MixedSourcesError(
                "import bundles and FlashInfer cache files in separate commands"
            )
        return BUNDLE
    return FLASHINFER


def read_files(paths: Iterable[Path]) -> list[tuple[str, CacheFile, Path]]:
    """``(name, parsed file, path)`` of each FlashInfer file, in order (the path dates it)."""
    return [(str(p), read_cache_file(p), p) for p in paths]


def read_bundles(paths: Sequence[Path]) -> list[tuple[str, Bundle]]:
    """``(name, verified bundle)`` of each bundle, in order."""
    return [(str(p), read_bundle(p)) for p in paths]


def read_stores(
    paths: Sequence[Path], *, hint: Callable[[Path], str] | None = None
) -> list[StoreContents]:
    """Each v2 store (root or environment directory), in order; another directory is
    refused, with ``hint(directory)`` saying what to give instead (the CLI passes
    ``adopt.import_hint``; this module does not import the adoption, which writes)."""
    return [read_store(p, hint=hint) for p in paths]


def _is_dir(path: Path) -> bool:
    """``path.is_dir()``, False where the file system cannot look the name up (too long...)."""
    try:
        return path.is_dir()
    except (OSError, ValueError):
        return False


__all__ = [
    "BUNDLE",
    "DIRECTORY",
    "FLASHINFER",
    "REGISTRY",
    "V2_STORE",
    "MixedSourcesError",
    "import_kind",
    "read_bundles",
    "read_files",
    "read_stores",
    "recognise",
]
