"""What a server start imports: non-zero ranks never load SQLAlchemy or Alembic.

Real gloo ranks in fresh processes (``ficache._ranks.run_ranks``), the real
FlashInfer AutoTuner filled by the CPU stand-in, a real SQLite registry.
"""

from __future__ import annotations

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


def test_warm_rank_zero_on_a_sqlite_file_imports_no_alembic(tmp_path: Path) -> None:
    db = str(tmp_path / "registry.db")
    env = {"XDG_CACHE_HOME": str(tmp_path / "user-cache"), "FICACHE_DB": None}
    run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    warm = run_ranks(start_and_list_modules, 2, db, timeout=240.0, env=env)
    assert warm[0]["report"]["tuned"] == 0 and warm[0]["report"]["loaded"] > 0
    assert "alembic" not in warm[0]["heavy"]


def test_the_declared_head_is_alembics_head() -> None:
    from ficache import schema

    assert schema.declared_head() == schema.head_revision()


def test_importing_the_protocol_imports_no_registry() -> None:
    code = (
        "import sys, ficache, ficache.sync\n"
        "heavy = [m for m in ('sqlalchemy', 'alembic', 'ficache.registry', 'ficache.schema')"
        " if m in sys.modules]\n"
        "assert heavy == [], heavy\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
