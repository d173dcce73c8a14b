"""What a server start imports: non-zero ranks never load SQLAlchemy or Alembic.

Real gloo ranks in fresh processes (``ficache._ranks.run_ranks``), the real
FlashInfer AutoTuner filled by the CPU stand-in, a real SQLite registry.
"""

from __future__ import annotations

import sqlite3
import subprocess
import sys
from pathlib import Path

from start_imports_scenario import start_and_list_modules

from ficache._ranks import run_ranks


def test_non_zero_ranks_import_no_sqlalchemy_or_alembic(tmp_path: Path) -> None:
    db = str(tmp_path / "registry.db")
    env = {"XDG_CACHE_HOME": str(tmp_path / "user-cache"), "FICACHE_DB": None}
    cold = run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    warm = run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    assert cold[0]["report"]["committed"] > 0  # the first start tuned and committed
    assert warm[1]["report"]["loaded"] == cold[0]["report"]["committed"]
    assert warm[1]["report"]["tuned"] == 0
    assert cold[1]["heavy"] == []
    assert warm[1]["heavy"] == []


def test_warm_rank_zero_on_a_sqlite_file_imports_no_sqlalchemy_or_alembic(tmp_path: Path) -> None:
    """Rank 0 reads the registry's state over ``sqlite3``, serves the cached slices and
    writes its served mark the same way: no engine, no models, no registry."""
    db = str(tmp_path / "registry.db")
    env = {"XDG_CACHE_HOME": str(tmp_path / "user-cache"), "FICACHE_DB": None}
    run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    before = served_starts(db)
    warm = run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    assert warm[0]["report"]["tuned"] == 0 and warm[0]["report"]["loaded"] > 0
    assert warm[0]["report"]["slice_cache"] == "hit"
    assert warm[0]["heavy"] == []
    assert served_starts(db) == before + 1  # the mark was written, over sqlite3


def test_a_rank_zero_start_that_must_render_its_slices_still_opens_the_registry(
    tmp_path: Path,
) -> None:
    """The light path is only the slice cache's hit: once the registry changed (here a row
    updated behind its back, which moves the state token) rank 0 renders its slices
    through the registry again (``Registry.open``, with its schema checks)."""
    db = str(tmp_path / "registry.db")
    env = {"XDG_CACHE_HOME": str(tmp_path / "user-cache"), "FICACHE_DB": None}
    run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    with sqlite3.connect(db) as conn:  # behind the registry's back: the state token moves
        conn.execute("UPDATE entries SET updated_at = updated_at + 1 WHERE id = 1")
    warm = run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    assert warm[0]["report"]["slice_cache"] == "miss"
    assert warm[0]["report"]["tuned"] == 0 and warm[0]["report"]["loaded"] > 0
    assert {"sqlalchemy", "ficache.registry"} <= set(warm[0]["heavy"])


def test_the_fast_paths_table_names_are_the_models() -> None:
    from ficache import sqlite_fast
    from ficache.models import (
        CommitRow,
        EntryRow,
        FingerprintRow,
        ProtocolRecordRow,
        RecordRow,
    )

    assert (
        CommitRow.__tablename__,
        EntryRow.__tablename__,
        RecordRow.__tablename__,
        ProtocolRecordRow.__tablename__,
        FingerprintRow.__tablename__,
    ) == (
        sqlite_fast.COMMITS_TABLE,
        sqlite_fast.ENTRIES_TABLE,
        sqlite_fast.RECORDS_TABLE,
        sqlite_fast.PROTOCOL_RECORDS_TABLE,
        sqlite_fast.FINGERPRINTS_TABLE,
    )


def served_starts(db: str) -> int:
    with sqlite3.connect(db) as conn:
        return int(conn.execute("SELECT sum(served_starts) FROM fingerprints").fetchone()[0] or 0)


def test_the_declared_head_is_alembics_head() -> None:
    from ficache import schema

    assert schema.declared_head() == schema.head_revision()


def test_importing_the_protocol_imports_no_registry() -> None:
    code = (
        "import sys, ficache, ficache.sync, ficache.slices, ficache.usage, ficache.location\n"
        "heavy = [m for m in ('sqlalchemy', 'alembic', 'ficache.registry', 'ficache.schema')"
        " if m in sys.modules]\n"
        "assert heavy == [], heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
