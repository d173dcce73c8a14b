"""``ficache env``: what ficache uses on this machine, read without changing anything.

The registry a command or a start resolves (and from where: ``--db``,
``FICACHE_DB`` or the default) with its schema revision, every variable
ficache or its plugins read with the value in effect and what it means, the
slice cache's directory and size, and the versions installed.

Invariants:
- Reads only: never creates a registry, a directory or a file; a registry it
  cannot read is reported with the reason (``registry_problem``), never raised.
- Imports neither FlashInfer nor torch: versions come from package metadata,
  the engines' roots from the variables as the engines resolve them.
- A variable's meaning is computed by the function the plugins call
  (``ficache.engine_env``), so what this shows is what a start does.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from ficache.errors import FicacheError
from ficache.location import ENV_VAR as DB_VAR
from ficache.location import default_registry_path

#: The distributions whose versions decide what a registry's fingerprints match.
PACKAGES = ("ficache", "flashinfer-python", "torch", "sqlalchemy", "alembic", "psycopg")


@dataclass(frozen=True)
class Variable:
    """One environment variable: its value here (None: unset) and what it means."""

    name: str
    value: str | None
    effect: str


@dataclass(frozen=True)
class EnvReport:
    registry: str
    #: ``--db``, ``FICACHE_DB`` or ``default``.
    registry_source: str
    #: The schema revision, ``None`` when there is no registry (yet) or it cannot be read.
    registry_revision: str | None
    head_revision: str
    #: Why the registry could not be read, or ``"not created yet"``; None when it was read.
    registry_problem: str | None
    slice_cache: str
    slice_cache_files: int
    slice_cache_bytes: int
    versions: dict[str, str | None]
    variables: tuple[Variable, ...]

    def as_json(self) -> dict[str, Any]:
        return asdict(self)


def collect(db: str | None) -> EnvReport:
    """What ficache uses here, for the registry named by ``db`` (None: ``FICACHE_DB``,
    then the default), as ``ficache env`` shows it."""
    from ficache import schema

    given = db if db is not None else os.environ.get(DB_VAR) or None
    if given is None:
        source = "default"
    elif db is None or db == os.environ.get(DB_VAR):
        source = DB_VAR
    else:
        source = "--db"
    location = schema.resolve(given)
    revision, problem = _revision(given, location)
    slices, files, size = _slice_cache()
    return EnvReport(
        registry=location.display,
        registry_source=source,
        registry_revision=revision,
        head_revision=schema.head_revision(),
        registry_problem=problem,
        slice_cache=str(slices),
        slice_cache_files=files,
        slice_cache_bytes=size,
        versions={name: _version(name) for name in PACKAGES},
        variables=_variables(),
    )


def _revision(given: str | None, location: Any) -> tuple[str | None, str | None]:
    if location.path is not None and not location.path.exists():
        return None, "not created yet"
    from ficache.registry_schema import RegistrySchema

    try:
        with RegistrySchema.open(given, create=False) as target:
            return target.revision().revision, None
    except FicacheError as exc:
        return None, str(exc)


def _slice_cache() -> tuple[Path, int, int]:
    from ficache.slices import default_cache_dir

    root = default_cache_dir()
    files = size = 0
    if root.is_dir():
        for path in root.rglob("*"):
            if path.is_file():
                files += 1
                size += path.stat().st_size
    return root, files, size


def _version(name: str) -> str | None:
    if name == "ficache":
        from ficache import __version__

        return __version__
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def _variables() -> tuple[Variable, ...]:
    from ficache import adopt, engine_env, sglang_cache

    def on_off(name: str) -> str:
        return "on" if engine_env.switch(name) else "off"

    def allowlist(name: str) -> str:
        raw = os.environ.get(name)
        if raw is None:
            return "unset: every installed plugin loads, ficache's too"
        allowed = [p.strip() for p in raw.split(",") if p.strip()]
        return (
            "ficache is allowed"
            if "ficache" in allowed
            else "ficache is NOT allowed: it never loads"
        )

    env = os.environ
    rows = [
        (DB_VAR, f"registry: {env.get(DB_VAR) or default_registry_path()}"),
        (engine_env.ENV_MODE, f"start mode: {engine_env.start_mode()}"),
        (
            engine_env.ENV_REGISTRY_TIMEOUT,
            f"a start waits at most {engine_env.registry_timeout():g} s per phase on the registry",
        ),
        ("FICACHE_VLLM", f"vLLM plugin: {on_off('FICACHE_VLLM')}"),
        ("FICACHE_SGLANG", f"SGLang plugin: {on_off('FICACHE_SGLANG')}"),
        (
            engine_env.ENV_ADOPT,
            f"adopt the engine's own caches into an empty registry: {on_off(engine_env.ENV_ADOPT)}",
        ),
        ("VLLM_PLUGINS", allowlist("VLLM_PLUGINS")),
        ("SGLANG_PLUGINS", allowlist("SGLANG_PLUGINS")),
        ("VLLM_CACHE_ROOT", f"vLLM's caches, adopted from: {adopt.default_vllm_cache_root()}"),
        (
            "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
            "vLLM's autotune files and v2 store, adopted from there too"
            if env.get("VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR")
            else "unset: vLLM uses its cache root and FlashInfer's default store",
        ),
        (
            "FLASHINFER_AUTOTUNE_CACHE_DIR",
            f"FlashInfer's v2 store root: {adopt.default_flashinfer_v2_root()}",
        ),
        (
            "SGLANG_CACHE_DIR",
            f"SGLang's autotune files, adopted from: {sglang_cache.default_root()}",
        ),
    ]
    return tuple(Variable(name, env.get(name), effect) for name, effect in rows)
