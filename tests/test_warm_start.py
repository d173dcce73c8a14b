"""ficache.warm_start in one process (world 1): real SQLite, the real AutoTuner.

The multi-rank protocol is in test_sync.py; these cover what does not need
peers: reports, commits and their provenance, the slice cache, failures that
become "tune uncached", exception propagation, and the light import. Tests
marked ``@both_backends`` also run with a PostgreSQL registry.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ficache
from ficache import schema
from ficache.registry import Registry
from ficache.standin import standin_tune
from ficache.tuner import FlashInferTuner

#: Runs a test on SQLite and on PostgreSQL (``registry_db`` follows ``backend``).
both_backends = pytest.mark.usefixtures("backend")


def start(db: Path | str, **kwargs: Any) -> tuple[Any, Any]:
    with ficache.warm_start(db=db, **kwargs) as ws:
        result = standin_tune()
    return ws.report, result


@both_backends
def test_cold_then_warm_in_one_process(registry_db: str, autotuner: Any) -> None:
    db = registry_db
    cold, tuned = start(db, provenance={"framework": "test", "model": "m"})
    assert (cold.status, cold.loaded, cold.tuned, cold.committed, cold.commit_id) == (
        "cold",
        0,
        18,
        18,
        1,
    )
    assert (cold.rank, cold.world_size, cold.layout, cold.shared, cold.scoped) == (
        0,
        1,
        "world1",
        18,
        0,
    )
    assert cold.synchronized and cold.reason is None and cold.registry == schema.resolve(db).display
    assert tuned.profiled == 18
    assert set(cold.seconds) >= {
        "prepare",
        "export",
        "load",
        "confirm",
        "block",
        "exchange",
        "commit",
        "total",
    }
    json.dumps(cold.as_json())  # JSON as it is

    warm, again = start(db)
    assert (warm.status, warm.loaded, warm.tuned, warm.committed, warm.commit_id) == (
        "warm",
        18,
        0,
        0,
        None,
    )
    assert warm.slice_cache == "hit" and again.profiled == 0
    with Registry.open(db) as reg:
        (commit,) = reg.log()
        assert commit.kind == "startup" and commit.world_size == 1 and commit.layout == "world1"
        assert commit.added == 18
        assert commit.provenance["protocol"] == "ficache.warm_start"
        assert commit.provenance["synchronized"] is True
        assert commit.provenance["framework"] == "test" and commit.provenance["model"] == "m"


@both_backends
def test_layout_names_the_scope_of_a_single_rank(registry_db: str, autotuner: Any) -> None:
    db = registry_db
    report, _ = start(db, layout="tp1", synchronize=False)
    assert report.layout == "tp1" and report.scoped == 18 and report.shared == 0
    with Registry.open(str(db)) as reg:
        assert {e.scope for e in reg.entries()} == {"tp1/rank0"}
    warm, again = start(db, layout="tp1")
    assert warm.loaded == 18 and again.profiled == 0
    other, _ = start(db, layout="tp2")  # another layout does not see tp1's entries
    assert other.loaded == 0


@both_backends
def test_an_exception_in_the_block_propagates_and_commits_nothing(
    registry_db: str, autotuner: Any
) -> None:
    db = registry_db
    with pytest.raises(KeyError, match="boom"), ficache.warm_start(db=db) as ws:
        standin_tune()
        raise KeyError("boom")
    assert ws.report.committed == 0 and ws.report.tuned == 18
    assert (
        ws.report.reason
        == "nothing committed: rank 0 raised KeyError: 'boom' in the warm-start block"
    )
    with Registry.open(str(db)) as reg:
        assert reg.log() == []


@pytest.mark.parametrize("fault", ["corrupt", "damaged", "newer-schema", "not-a-dir"])
def test_registry_faults_become_tune_uncached(tmp_path: Path, autotuner: Any, fault: str) -> None:
    """``damaged`` (issue 35, bug 3): a file SQLite reports malformed in pages the start
    does not read was served from, and could be written."""
    db = tmp_path / "registry.db"
    if fault == "corrupt":
        db.write_bytes(b"\x00garbage" * 64)
    elif fault == "damaged":
        from damage import damage_history

        start(db)
        damage_history(db)
    elif fault == "newer-schema":
        start(db)
        import sqlite3

        conn = sqlite3.connect(db)
        conn.execute("UPDATE alembic_version SET version_num = 'zzzz_future'")
        conn.commit()
        conn.close()
    else:
        (tmp_path / "file").write_text("x")
        db = tmp_path / "file" / "registry.db"
    before = db.read_bytes() if db.is_file() else None
    report, tuned = start(db)
    assert report.status == "uncached" and report.reason
    if fault == "damaged":
        assert "is damaged (SQLite: " in report.reason
        assert "run `ficache verify`" in report.reason
    assert (report.loaded, report.tuned, report.committed) == (0, 18, 0)
    assert tuned.profiled == 18  # the block ran and tuned
    if before is not None:
        assert db.read_bytes() == before


@both_backends
def test_an_older_schema_is_upgraded_in_a_sqlite_file_but_a_shared_one_tunes_uncached(
    registry_db: str, registry_path: Path, autotuner: Any, dump_db: Any
) -> None:
    db = registry_db
    start(db, provenance={"framework": "test"})
    location = schema.resolve(db)
    engine, _readonly = schema.make_engine(location)
    try:
        schema.downgrade(engine, location, "0004_selection")
    finally:
        engine.dispose()
    before = dump_db(db)

    report, tuned = start(db)

    if db == str(registry_path):  # a local file: upgraded under the lock, then served
        assert (report.status, report.loaded, report.committed) == ("warm", 18, 0)
        assert [w for w in report.warnings if w.startswith("upgraded registry")] == [
            f"upgraded registry {location.display} from schema '0004_selection' to "
            f"{schema.head_revision()!r} (a local file older than this ficache reads)"
        ]
        with Registry.open(db) as reg:
            assert reg.stats().revision == schema.head_revision()
    else:  # a server other ficache versions share: never upgraded by a start
        assert report.status == "uncached"
        assert (report.loaded, report.tuned, report.committed, tuned.profiled) == (0, 18, 0, 18)
        assert report.reason is not None
        assert report.reason.endswith(
            "is at schema '0004_selection', older than this ficache "
            f"({schema.head_revision()!r}); a shared registry is upgraded only by "
            "`ficache db upgrade`"
        )
        assert dump_db(db) == before


@both_backends
def test_load_failure_tunes_from_empty(registry_db: str, autotuner: Any) -> None:
    class FailingLoadTuner(FlashInferTuner):  # fault injection
        def load(self, text: str) -> int:
            raise ficache.FicacheError("injected")

    db = registry_db
    start(db)
    autotuner.clear_cache()  # else the tuner holds the slice already and keeps it (no load)
    report, tuned = start(db, tuner=FailingLoadTuner())
    assert report.status == "uncached"
    assert report.reason.startswith("rank 0 could not load its slice")
    assert (report.loaded, report.tuned, report.committed, tuned.profiled) == (0, 18, 0, 18)


def test_read_only_registry_loads_and_says_it_commits_nothing(
    tmp_path: Path, autotuner: Any
) -> None:
    db = tmp_path / "registry.db"
    with ficache.warm_start(db=db) as ws:
        standin_tune(shapes=((128, 128),))
    report, tuned = start(f"sqlite:///file:{db}?mode=ro&uri=true")
    assert (report.loaded, report.tuned, report.committed) == (6, 12, 0)
    assert "read-only" in report.reason
    assert ws.report.committed == 6


def test_invalid_layout_is_refused_before_anything(tmp_path: Path) -> None:
    with (
        pytest.raises(ValueError, match="layout"),
        ficache.warm_start(db=tmp_path / "r.db", layout="a/b"),
    ):
        pass
    assert not (tmp_path / "r.db").exists()


def test_autotune_process_group_is_cleared_on_exit(tmp_path: Path, autotuner: Any) -> None:
    from flashinfer.autotuner import get_autotune_process_group

    with pytest.raises(RuntimeError), ficache.warm_start(db=tmp_path / "r.db"):
        raise RuntimeError("x")
    assert get_autotune_process_group() is None


def test_import_ficache_stays_light() -> None:
    code = (
        "import sys, ficache\n"
        "assert 'torch' not in sys.modules and 'flashinfer' not in sys.modules\n"
        "assert callable(ficache.warm_start) and ficache.WarmStartReport.__name__ == 'WarmStartReport'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
