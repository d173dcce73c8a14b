"""Shared fixtures: real SQLite registries in ``tmp_path``, the real CLI, real
FlashInfer cache files and the real FlashInfer ``AutoTuner``.

- ``registry_path``: a registry file path under ``tmp_path`` (not created).
- ``backend``: ``"sqlite"`` or ``"postgres"``. A test that requests it (or is
  marked ``usefixtures("backend")``) runs once per backend, and its
  ``registry_db`` and ``cli`` follow; the PostgreSQL case is marked
  ``postgres`` and runs only with ``FICACHE_TEST_POSTGRES=1`` (``tox -e
  test`` sets it and runs both backends; ``tox -e postgres`` runs only
  ``pytest -m postgres``); without it the PostgreSQL cases are deselected
  and one summary line says why.
- ``registry_db``: where the test's registry lives, as ``--db`` takes it:
  ``str(registry_path)``, or, in a test's PostgreSQL case, the URL of a fresh
  database of its own (``postgres_url``).
- ``postgres_server`` (session) and ``postgres_url``: one real PostgreSQL
  server per session (``tests/pg_server.py``), a new empty database per test,
  dropped after it.
- ``cli``: ``cli(*args, db=registry_db, input=None)`` runs ``ficache`` through
  click's ``CliRunner`` with ``--db``; pass ``db=None`` to omit it. Returns
  click's ``Result`` (``exit_code``, ``stdout``, ``stderr``).
- ``created_note``: ``created_note(db)`` is what the CLI writes on stderr when
  its write creates the SQLite registry ``db`` ("note: creating a new registry at
  PATH"), or ``""`` for a server's URL (a database is never created).
- ``cache_file``: ``cache_file(name, entries, metadata=CURRENT, generation=None)``
  writes a FlashInfer-shaped cache file under ``tmp_path`` and returns its
  path. ``metadata`` is ``CURRENT`` (this environment's
  ``flashinfer.autotuner._collect_metadata()``), a dict, or ``None`` (no
  ``_metadata``, as older FlashInfer wrote).
- ``autotuner``: the real ``AutoTuner.get()`` singleton, cleared before and
  after the test.
- ``dump_db``: ``dump_db(db)`` is the database's full content, for "registry
  unchanged" checks: a SQLite file's SQL dump (a list of statements), or for a
  PostgreSQL URL every table's columns and all its rows, in order.

Every test runs with ``FICACHE_DB`` unset and the user cache dir inside
``tmp_path``, so nothing reaches the real default registry.
"""

from __future__ import annotations

import json
import os
import sqlite3
import sys
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import hypothesis
import pg_server
import pytest
from click.testing import CliRunner, Result

#: ``cache_file(..., metadata=CURRENT)``: this environment's FlashInfer metadata.
CURRENT = "current"


# No per-example deadline: CI runs on a loaded 2-core machine, where a slow
# example is noise, not a failure (a deadline would make property tests flaky).
# Tests still set their own max_examples; hangs are the hard timeouts' job.
hypothesis.settings.register_profile(
    "ficache", deadline=None, suppress_health_check=[hypothesis.HealthCheck.too_slow]
)
hypothesis.settings.load_profile("ficache")


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--reverse",
        action="store_true",
        help="Run the collected tests in reverse order (tests must not depend on their order).",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if config.getoption("--reverse"):
        items.reverse()
    _deselect_postgres_cases(config, items)


_POSTGRES_DESELECTED = pytest.StashKey[int]()


def _deselect_postgres_cases(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Without ``FICACHE_TEST_POSTGRES=1`` the PostgreSQL cases do not run; one
    summary line says so and why (rather than one skip line per case)."""
    if pg_server.enabled():
        return
    postgres = [item for item in items if item.get_closest_marker("postgres")]
    if postgres:
        config.hook.pytest_deselected(items=postgres)
        items[:] = [item for item in items if not item.get_closest_marker("postgres")]
        config.stash[_POSTGRES_DESELECTED] = len(postgres)


def pytest_terminal_summary(terminalreporter: Any, exitstatus: int, config: pytest.Config) -> None:
    deselected = config.stash.get(_POSTGRES_DESELECTED, 0)
    if deselected:
        terminalreporter.write_line(
            f"{deselected} PostgreSQL cases deselected: {pg_server.unavailable_reason()}"
        )


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


@pytest.fixture(scope="session")
def postgres_server() -> Iterator[pg_server.PostgresServer]:
    reason = pg_server.unavailable_reason()
    if reason is not None:
        if pg_server.enabled():
            pytest.fail(reason)
        pytest.skip(reason)
    server = pg_server.PostgresServer.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def postgres_url(postgres_server: pg_server.PostgresServer) -> Iterator[str]:
    with postgres_server.database() as url:
        yield url


BACKENDS = ["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    if request.param == "postgres":
        request.getfixturevalue("postgres_server")  # skips with its reason
    return str(request.param)


@pytest.fixture
def registry_db(request: pytest.FixtureRequest, registry_path: Path) -> str:
    if "backend" in request.fixturenames and request.getfixturevalue("backend") == "postgres":
        return str(request.getfixturevalue("postgres_url"))
    return str(registry_path)


@pytest.fixture
def cli(registry_db: str) -> Callable[..., Result]:
    from ficache.cli import cli as ficache_cli

    runner = CliRunner()

    def invoke(*args: str, db: str | Path | None = registry_db, input: str | None = None) -> Result:
        argv = (["--db", str(db)] if db is not None else []) + [str(a) for a in args]
        return runner.invoke(
            ficache_cli, argv, input=input, catch_exceptions=True, prog_name="ficache"
        )

    return invoke


@pytest.fixture
def created_note() -> Callable[[str | Path], str]:
    from ficache import schema

    def note(db: str | Path) -> str:
        location = schema.resolve(str(db))
        return f"note: creating a new registry at {location.display}\n" if location.path else ""

    return note


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


@pytest.fixture(autouse=True)
def _no_served_mark_outlives_its_test() -> Iterator[None]:
    """A served mark a test's start left writing on its own thread (``ficache.usage``) is
    done before the next test, whose files and registries it must not touch."""
    yield
    assert _wait_for_served_marks(timeout=60), "a served mark's thread did not end in 60 s"


def _wait_for_served_marks(timeout: float | None = None) -> bool:
    usage = sys.modules.get("ficache.usage")  # never loaded: no start ran in this process
    return usage is None or bool(usage.wait_for_served_marks(timeout))


@pytest.fixture(autouse=True)
def _no_managed_store_outlives_its_test() -> Iterator[None]:
    """A FlashInfer managed store a test's start attached (v2 mode keeps it attached for the
    life of the process, as a server's) is detached and forgotten after that test, so the
    next test in this process starts as a fresh server would, not in the previous test's
    store: a tuner that ever registered a store never keeps a slice (``ficache.tuner``), so
    a registration left behind would change what a later test's start does."""
    yield
    autotuner_module = sys.modules.get("flashinfer.autotuner")
    if autotuner_module is None:
        return
    tuner = getattr(autotuner_module.AutoTuner, "_instance", None)
    if tuner is None:
        return
    with tuner._lock:
        if getattr(tuner, "_managed_cache", None) is not None:
            tuner._managed_cache = None
        stores = getattr(tuner, "_managed_stores", None)
        if stores:
            stores.clear()


@pytest.fixture
def autotuner() -> Iterator[Any]:
    from flashinfer.autotuner import AutoTuner

    tuner = AutoTuner.get()
    tuner.clear_cache()
    yield tuner
    tuner.clear_cache()


def _dump(db: str | Path) -> list[str]:
    """Every row of the registry at ``db``, once the served marks this process's starts
    write on threads of their own (``ficache.usage.mark_served_after_start``) are done."""
    _wait_for_served_marks()
    if str(db).startswith("postgresql"):
        return _dump_postgres(str(db))
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return list(conn.iterdump())
    finally:
        conn.close()


def _dump_postgres(url: str) -> list[str]:
    """Every table's name and columns, then all its rows ordered by every column."""
    from sqlalchemy import create_engine, inspect, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(url, poolclass=NullPool)
    try:
        lines: list[str] = []
        with engine.connect() as conn:
            inspector = inspect(conn)
            for table in sorted(inspector.get_table_names()):
                columns = inspector.get_columns(table)
                lines.append(f"{table}: " + ", ".join(f"{c['name']} {c['type']}" for c in columns))
                order = ", ".join(str(i) for i in range(1, len(columns) + 1))
                rows = conn.execute(text(f'SELECT * FROM "{table}" ORDER BY {order}'))
                lines.extend(f"{table} {tuple(row)!r}" for row in rows)
        return lines
    finally:
        engine.dispose()


@pytest.fixture
def dump_db() -> Callable[[str | Path], list[str]]:
    return _dump


@pytest.fixture
def umask() -> Iterator[Callable[[int], int]]:
    """``umask(MASK)`` sets the process umask for the rest of the test; restored after."""
    old = os.umask(0o022)
    os.umask(old)
    try:
        yield os.umask
    finally:
        os.umask(old)


@pytest.fixture(scope="module")
def forker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    """One forker per test module (``tests/forker.py``: torch imported once, children forked)."""
    from forker import Forker

    f = Forker(tmp_path_factory.mktemp("forker"))
    try:
        yield f
    finally:
        f.stop()
