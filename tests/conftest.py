"""Shared fixtures: real SQLite registries in ``tmp_path``, the real CLI, real
FlashInfer cache files and the real FlashInfer ``AutoTuner``.

- ``registry_path``: a registry file path under ``tmp_path`` (not created).
- ``cli``: ``cli(*args, db=registry_path, input=None)`` runs ``ficache`` through
  click's ``CliRunner`` with ``--db``; pass ``db=None`` to omit it. Returns
  click's ``Result`` (``exit_code``, ``stdout``, ``stderr``).
- ``cache_file``: ``cache_file(name, entries, metadata=CURRENT, generation=None)``
  writes a FlashInfer-shaped cache file under ``tmp_path`` and returns its
  path. ``metadata`` is ``CURRENT`` (this environment's
  ``flashinfer.autotuner._collect_metadata()``), a dict, or ``None`` (no
  ``_metadata``, as older FlashInfer wrote).
- ``autotuner``: the real ``AutoTuner.get()`` singleton, cleared before and
  after the test.
- ``dump_db``: ``dump_db(path)`` is the database's full SQL dump (a list of
  statements), for "registry unchanged" checks.

Every test runs with ``FICACHE_DB`` unset and the user cache dir inside
``tmp_path``, so nothing reaches the real default registry.
"""

from __future__ import annotations

import json
import sqlite3
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
from click.testing import CliRunner, Result

#: ``cache_file(..., metadata=CURRENT)``: this environment's FlashInfer metadata.
CURRENT = "current"


def pytest_configure(config: pytest.Config) -> None:
    # Importing FlashInfer imports the CUTLASS DSL, which warns about its own renames.
    config.addinivalue_line("filterwarnings", r"ignore:cutlass\.:DeprecationWarning")


@pytest.fixture(autouse=True)
def _isolated_registry_env(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("FICACHE_DB", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "user-cache"))


@pytest.fixture
def registry_path(tmp_path: Path) -> Path:
    return tmp_path / "registry.db"


@pytest.fixture
def cli(registry_path: Path) -> Callable[..., Result]:
    from ficache.cli import cli as ficache_cli

    runner = CliRunner()

    def invoke(
        *args: str, db: str | Path | None = registry_path, input: str | None = None
    ) -> Result:
        argv = (["--db", str(db)] if db is not None else []) + [str(a) for a in args]
        return runner.invoke(
            ficache_cli, argv, input=input, catch_exceptions=True, prog_name="ficache"
        )

    return invoke


def current_metadata() -> dict[str, str]:
    """This environment's FlashInfer ``_metadata`` (imports FlashInfer, ~7 s once)."""
    from flashinfer.autotuner import _collect_metadata

    return dict(_collect_metadata())


@pytest.fixture
def cache_file(tmp_path: Path) -> Callable[..., Path]:
    def write(
        name: str,
        entries: Mapping[str, list[Any]],
        metadata: Mapping[str, Any] | str | None = CURRENT,
        generation: str | None = None,
    ) -> Path:
        data: dict[str, Any] = {}
        if metadata == CURRENT:
            data["_metadata"] = current_metadata()
        elif metadata is not None:
            data["_metadata"] = dict(metadata)  # type: ignore[arg-type]
        data.update(entries)
        if generation is not None:
            data["_generation"] = generation
        path = tmp_path / name
        path.write_text(json.dumps(data, indent=2))
        return path

    return write


@pytest.fixture
def autotuner() -> Iterator[Any]:
    from flashinfer.autotuner import AutoTuner

    tuner = AutoTuner.get()
    tuner.clear_cache()
    yield tuner
    tuner.clear_cache()


def _dump(path: str | Path) -> list[str]:
    conn = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


@pytest.fixture
def dump_db() -> Callable[[str | Path], list[str]]:
    return _dump
