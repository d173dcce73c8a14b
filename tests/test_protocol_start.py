"""A warm start serves FlashInfer 0.7.4's protocol records and commits the ones published in
its block, on the v1 path (in memory) and the v2 path (in the managed store).

2 and 4 real gloo ranks run ``tests/protocol_scenarios.py`` (a hard timeout
kills them): a cold start on each path, then, in fresh processes, a warm
start and a start after one protocol record was deleted behind the
registry's back; on 2 ranks, a start whose rank 1 raises mid-block while
rank 0 publishes. One process covers the tuner adapter against FlashInfer's
public reads, a FlashInfer without protocol records, and replay mode.
"""

from __future__ import annotations

import json
import re
import sqlite3
from pathlib import Path
from typing import Any

import protocol_scenarios
import pytest
from flashinfer_074 import require_protocol_records
from gloo_scenarios import GROUP_TIMEOUT

import ficache
from ficache._ranks import run_ranks
from ficache.flashinfer_format import canonical_json
from ficache.standin_protocol import KEYS, run_standin_protocol
from ficache.standin_protocol import NAMESPACE as NS
from ficache.standin_protocol import standin_value as knob_value
from ficache.tuner import FlashInferTuner
from ficache.verify import verify

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def _flashinfer_with_protocol_records() -> None:
    """Before any rank starts: skipped without FlashInfer's protocol records, failed under CI."""
    require_protocol_records()


#: Hang guard: every rank is killed after this long; never compared with a duration.
HARD_TIMEOUT = 900.0
PATHS = ["v1", "v2"]
ALL_KNOBS = {key: knob_value(key) for key in KEYS}


def _checked(results: list[dict[str, Any]]) -> list[dict[str, Any]]:
    for rank, out in enumerate(results):
        assert "error" not in out, f"rank {rank} failed:\n{out['error']}"
    return results


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def runs(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    world = request.param
    root = tmp_path_factory.mktemp(f"protocol-start-{world}")
    cold = run_ranks(
        protocol_scenarios.cold,
        world,
        str(root),
        timeout=HARD_TIMEOUT,
        group_timeout=GROUP_TIMEOUT,
    )
    later = run_ranks(
        protocol_scenarios.warm_then_one_deleted,
        world,
        str(root),
        timeout=HARD_TIMEOUT,
        group_timeout=GROUP_TIMEOUT,
    )
    return _checked(cold), _checked(later), root


@pytest.mark.parametrize("path", PATHS)
def test_cold_commits_what_rank_0_published_and_every_rank_then_holds_it(
    runs: Any, path: str
) -> None:
    cold, _later, _root = runs
    for rank, out in enumerate(cold):
        start = out[path]
        report = start["report"]
        assert start["exception"] is None, start
        assert start["seen"] == {} and start["hits"] == 0, start
        assert start["published"] == (len(KEYS) if rank == 0 else 0)
        assert report["status"] == "cold", report
        assert report["protocol_tuned"] == (len(KEYS) if rank == 0 else 0), report
        assert report["protocol_committed"] == len(KEYS), report
        assert report["committed"] == 12 and report["reason"] is None, report
        # The final slice is published on every rank: all read the same values.
        assert start["held_after"] == ALL_KNOBS, (rank, start["held_after"])
    assert cold[0][f"{path}_verified"] is True


@pytest.mark.parametrize("path", PATHS)
def test_a_warm_start_in_fresh_processes_serves_them_and_publishes_nothing(
    runs: Any, path: str
) -> None:
    _cold, later, _root = runs
    for out in later:
        start = out[path]
        report = start["report"]
        assert start["exception"] is None, start
        # Read inside the block before the protocol ran: every rank holds every record.
        assert start["seen"] == ALL_KNOBS, start["seen"]
        assert (start["hits"], start["published"]) == (len(KEYS), 0), start
        assert report["status"] == "warm", report
        assert report["protocol_loaded"] == len(KEYS), report
        assert (report["protocol_tuned"], report["protocol_committed"]) == (0, 0), report
        assert report["commit_id"] is None, report


@pytest.mark.parametrize("path", PATHS)
def test_a_record_deleted_behind_the_registrys_back_is_published_again(
    runs: Any, path: str
) -> None:
    _cold, later, _root = runs
    for rank, out in enumerate(later):
        start = out[f"{path}_deleted"]
        report = start["report"]
        assert start["exception"] is None, start
        # The slice cache saw the delete: exactly that record is missing everywhere.
        assert start["seen"] == {k: v for k, v in ALL_KNOBS.items() if k != KEYS[1]}
        assert start["published"] == (1 if rank == 0 else 0), start
        assert report["status"] == "partial", report
        assert report["protocol_loaded"] == len(KEYS) - 1, report
        assert report["protocol_committed"] == 1 and report["committed"] == 0, report
        assert start["held_after"] == ALL_KNOBS
        assert out[f"{path}_stored"] == [
            ("shared", NS, key, canonical_json(knob_value(key))) for key in sorted(KEYS)
        ]


def test_ranks_other_than_0_serve_and_read_them_without_sqlalchemy(runs: Any) -> None:
    _cold, later, _root = runs
    # Fresh processes, two paths, three starts each (the v2 path reads protocol entry files
    # back from the store): only rank 0 opens the registry.
    for out in later[1:]:
        assert out["heavy_modules"] == [], out["heavy_modules"]
    # Rank 0 committed the re-published records, so it did open the registry: the check sees
    # an import where one happened.
    assert "sqlalchemy" in later[0]["heavy_modules"]


@pytest.fixture(scope="module")
def raising(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("protocol-raise")
    return _checked(
        run_ranks(
            protocol_scenarios.one_rank_raises_mid_block,
            2,
            str(root),
            timeout=HARD_TIMEOUT,
            group_timeout=GROUP_TIMEOUT,
        )
    )


@pytest.mark.parametrize("path", PATHS)
def test_a_rank_raising_mid_block_frees_its_peer_and_commits_nothing(
    raising: list[dict[str, Any]], path: str
) -> None:
    # Every rank came back (run_ranks' hard timeout did not fire): all left the protocol.
    for rank, out in enumerate(raising):
        assert out[path]["report"]["protocol_committed"] == len(KEYS), out[path]  # the cold start
        start = out[f"{path}_raise"]
        report = start["report"]
        if rank == 1:
            assert start["exception"] == f"RuntimeError: {protocol_scenarios.BOOM}", start
        else:
            # Rank 0 published the deleted record in its block, then was freed from the
            # tuning all-reduce its peer never joined.
            assert start["published"] == 1, start
            assert re.search("Connection (closed|reset) by peer", start["exception"]), start
        assert report["reason"].startswith("nothing committed: rank 1 raised"), report
        assert (report["committed"], report["protocol_committed"]) == (0, 0), report
        assert report["commit_id"] is None, report
    # Nothing committed: every commit, entry and protocol record row is as it was.
    before, after = raising[0][f"{path}_before"], raising[0][f"{path}_after"]
    assert after == before
    assert (len(before["entries"]), len(before["protocol_records"])) == (0, len(KEYS) - 1)


# -- one process ------------------------------------------------------------------------


def test_the_adapter_reads_what_flashinfers_public_api_returns(autotuner: Any) -> None:
    tuner = FlashInferTuner(autotuner)
    published = tuner.publish_protocol(
        {NS: {key: canonical_json(value) for key, value in ALL_KNOBS.items()}}
    )
    autotuner.publish_protocol_record("other.v1", "k", [1, 2], persist=False)

    assert published == len(KEYS)
    assert tuner.protocol_records() == {
        NS: autotuner.get_protocol_records(NS),
        "other.v1": autotuner.get_protocol_records("other.v1"),
    }
    assert tuner.protocol_records()[NS] == ALL_KNOBS
    tuner.clear()
    assert tuner.protocol_records() == {}


def test_a_flashinfer_without_protocol_records_serves_none_and_says_so() -> None:
    class NoProtocolTuner:
        """A stand-in for FlashInfer 0.7.2's AutoTuner: no protocol records at all."""

    tuner = FlashInferTuner(NoProtocolTuner())

    assert tuner.publish_protocol({NS: {"k": "1"}}) == 0
    assert tuner.protocol_records() == {}


def _one_start(db: str, **kwargs: Any) -> tuple[Any, dict[str, Any]]:
    from flashinfer import autotune

    with ficache.warm_start(db=db, **kwargs) as ws, autotune(True):
        protocol = run_standin_protocol(0)
    return ws.report, {"hits": protocol.hits, "published": protocol.published}


def test_replay_serves_protocol_records_and_commits_none(
    registry_path: Path, autotuner: Any
) -> None:
    db = str(registry_path)
    cold, _ = _one_start(db)
    conn = sqlite3.connect(registry_path)
    with conn:
        conn.execute("DELETE FROM protocol_records WHERE key = ?", (KEYS[0],))
    conn.close()

    replay, seen = _one_start(db, mode="replay")

    assert (cold.protocol_committed, cold.status) == (len(KEYS), "cold")
    # Replay never tunes: the served keys hit, the deleted one gets no value.
    assert (seen["hits"], seen["published"]) == (len(KEYS) - 1, 0)
    assert (replay.protocol_loaded, replay.protocol_tuned, replay.commit_id) == (2, 0, None)
    conn = sqlite3.connect(registry_path)
    assert conn.execute("SELECT count(*) FROM protocol_records").fetchone()[0] == 2
    conn.close()


def test_a_replay_start_whose_block_produces_an_entry_a_record_and_a_protocol_record_commits_none(
    registry_path: Path, autotuner: Any, dump_db: Any
) -> None:
    """Replay mode commits nothing, even what its block produced: an entry (the stand-in's
    loop stores a winner for shapes the registry lacks, as tuning would), a namespaced
    record and a protocol record. Only the served mark's counts may change."""
    from ficache.standin import standin_tune

    db = str(registry_path)
    with ficache.warm_start(db=db) as cold:
        standin_tune()
    assert cold.report.committed == 18
    before = [line for line in dump_db(db) if 'INTO "fingerprints"' not in line]

    with ficache.warm_start(db=db, mode="replay") as ws:
        produced = standin_tune(shapes=[(512, 512)])
        autotuner.publish_namespaced_records("replay_ns", {"k": {"v": 1}})
        autotuner.publish_protocol_record("replay.v1", "k", {"v": 2}, persist=False)

    report = ws.report
    assert produced.profiled == 6  # the block did produce entries
    assert (report.mode, report.tuned, report.records_tuned, report.protocol_tuned) == (
        "replay",
        6,
        1,
        1,
    )
    assert (report.committed, report.records_committed, report.protocol_committed) == (0, 0, 0)
    assert report.commit_id is None
    after = [line for line in dump_db(db) if 'INTO "fingerprints"' not in line]
    assert after == before


def test_a_stored_protocol_record_keeps_its_value_and_every_rank_reads_it(
    registry_path: Path, autotuner: Any
) -> None:
    db = str(registry_path)
    _one_start(db)
    # A block that republishes a served key with another value (a stand-in for a protocol
    # that re-tunes): the value stored first wins, as for entries and records.
    with ficache.warm_start(db=db) as ws:
        autotuner.publish_protocol_record(NS, KEYS[0], {"other": 1}, persist=False)

    report = ws.report
    assert (report.protocol_tuned, report.protocol_committed, report.kept) == (1, 0, 1)
    assert (
        "1 published protocol records not stored: the registry holds other values for those "
        "keys; every rank publishes the stored ones"
    ) in report.warnings
    assert autotuner.get_protocol_record(NS, KEYS[0]) == knob_value(KEYS[0])
    with sqlite3.connect(registry_path) as conn:
        values = dict(conn.execute("SELECT key, value FROM protocol_records").fetchall())
    assert json.loads(values[KEYS[0]]) == knob_value(KEYS[0])
    assert verify(db).ok
