"""Warm starts on groups smaller than the world: vLLM's TP groups under pipeline parallelism 2.

One 4-rank gloo job (``ficache._ranks.run_ranks``, a hard timeout), two
2-rank groups made with ``torch.distributed.new_group`` ({0, 1} and
{2, 3}), one registry shared by both; ``tests/subgroup_scenarios.py`` runs
the phases and says what each shows. The job runs once per module (about
a minute on 2 cores); the tests assert on what its ranks returned. The
PostgreSQL case runs the ``together`` phases against a real server.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import subgroup_scenarios
from reliability_log import record
from test_sync import assert_no_timeout

from ficache._ranks import run_ranks

pytestmark = pytest.mark.slow

ITEM = "groups smaller than the world"
WORLD = 4
ALL = 18
#: Hang guard: every rank is killed after this long (a run takes about a minute);
#: a deadlock fails the tests instead of hanging CI. Never compared with a duration.
HARD_TIMEOUT = 600.0
PHASES = ("alone", "together", "again", "fi_together", "fi_again")


def _run(root: Path, db_url: str | None, real_loop: bool) -> list[dict[str, Any]]:
    return run_ranks(
        subgroup_scenarios.run_plan,
        WORLD,
        str(root),
        db_url,
        real_loop,
        timeout=HARD_TIMEOUT,
        group_timeout=subgroup_scenarios.GROUP_TIMEOUT,
    )


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return _run(tmp_path_factory.mktemp("subgroups"), None, real_loop=True)


def _nodeid() -> str:
    """The running test's node id (``tests/test_x.py::test_y``), as RELIABILITY.md names it."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]


def _by_group(results: list[dict[str, Any]], phase: str) -> list[list[dict[str, Any]]]:
    return [[results[r][phase] for r in ranks] for ranks in subgroup_scenarios.GROUPS]


def _check_groups(results: list[dict[str, Any]], phase: str) -> None:
    """Every rank ended cleanly, tuned on its own group only, and agrees with its group."""
    for global_rank, result in enumerate(results):
        start = result[phase]
        assert start["exception"] is None, (phase, global_rank, start)
        assert_no_timeout(start, f"{phase} rank {global_rank}")
        report = start["report"]
        # Group ranks, not global ones: rank 2 is rank 0 of its group.
        assert (report["rank"], report["world_size"]) == (global_rank % 2, 2)
        assert report["layout"] == subgroup_scenarios.LAYOUT
        assert report["synchronized"] is True
        # FlashInfer all-reduced over exactly this rank's group.
        assert start["tuning_group"] == list(subgroup_scenarios.GROUPS[global_rank // 2])
    for group in _by_group(results, phase):
        assert group[0]["entries"] == group[1]["entries"]
        keep = ("status", "loaded", "tuned", "committed", "commit_id", "kept", "reason")
        assert {k: group[0]["report"][k] for k in keep} == {k: group[1]["report"][k] for k in keep}


def test_one_group_starts_while_the_other_joins_no_collective(job: list[dict[str, Any]]) -> None:
    for global_rank, result in enumerate(job):
        assert result["group"] == list(subgroup_scenarios.GROUPS[global_rank // 2])
        assert result["group_rank"] == global_rank % 2
    _check_groups(job, "alone")
    a, b = _by_group(job, "alone")
    # B's ranks waited outside every collective until A's rank 0 had finished its start.
    assert job[2]["waited_for_a"] is True and job[3]["waited_for_a"] is True
    for start in a:
        rep = start["report"]
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == ("cold", 0, 12, 12)
    for start in b:
        rep = start["report"]
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == (
            "partial",
            12,
            6,
            6,
        )
        assert start["standin"]["profiled"] == 6
    # Each group's leader (global ranks 0 and 2) made its group's commit, whole.
    commits = job[0]["alone_commits"]
    assert [(c["id"], c["added"], c["global_rank"]) for c in commits] == [(2, 6, 2), (1, 12, 0)]
    assert all(c["world_size"] == 2 and c["layout"] == subgroup_scenarios.LAYOUT for c in commits)
    assert {scope: len(keys) for scope, keys in job[0]["alone_stored"].items()} == {"shared": ALL}
    record(
        item=ITEM,
        test=_nodeid(),
        applied="group {0,1} warm-starts on a 4-rank job while group {2,3} joins no collective, then {2,3} on the same registry",
        outcome="no wait; commits by global ranks 0 (12 keys) and 2 (6 keys), each whole",
        ok=True,
        figures={"slowest_start_s": max(r["alone"]["report"]["seconds"]["total"] for r in job)},
    )


def _check_together(
    job: list[dict[str, Any]],
    phase: str,
    commits_key: str,
    stored_key: str,
    backend: str = "sqlite",
) -> dict[str, Any]:
    """Assert what two groups starting cold at once must show; return the reliability log
    row the caller records after its own last assertion."""
    _check_groups(job, phase)
    reports = [r[phase]["report"] for r in job]
    assert all(r[phase]["met"] is True for r in job)  # both groups tuned before either committed
    for rep in reports:
        assert (rep["status"], rep["loaded"], rep["tuned"]) == ("cold", 0, ALL)
        assert rep["reason"] is None
    leaders = [reports[0], reports[2]]
    # Both groups committed the same 18 keys at once: one commit holds all 18 (the first
    # writer's); the other group's values are either equal (nothing to write) or kept out.
    commits = job[0][commits_key]
    assert len(commits) == 1 and commits[0]["added"] == ALL and commits[0]["replaced"] == 0
    winner = 0 if commits[0]["global_rank"] == 0 else 1
    assert commits[0]["global_rank"] == (0, 2)[winner]
    assert leaders[winner]["committed"] == ALL and leaders[winner]["kept"] == 0
    assert leaders[1 - winner]["committed"] == 0 and leaders[1 - winner]["commit_id"] is None
    # shared and scoped count what each leader stored: the losing group stored nothing.
    assert (leaders[winner]["shared"], leaders[winner]["scoped"]) == (ALL, 0)
    assert (leaders[1 - winner]["shared"], leaders[1 - winner]["scoped"]) == (0, 0)
    stored = job[0][stored_key]
    assert list(stored) == ["shared"] and len(stored["shared"]) == ALL
    # Nothing lost, every rank of both groups ends on the stored values.
    for result in job:
        entries = result[phase]["entries"]
        assert {key: row[1] for key, row in entries.items()} == stored["shared"]
    return dict(
        item=ITEM,
        test=_nodeid(),
        applied="two 2-rank TP groups of a 4-rank job start cold at once on one registry and commit the same 18 keys",
        outcome=f"1 commit of 18 by global rank {commits[0]['global_rank']}; other group kept {leaders[1 - winner]['kept']} differing values out; all 4 ranks load the stored values",
        ok=True,
        figures={
            "kept": leaders[1 - winner]["kept"],
            "slowest_start_s": max(r["seconds"]["total"] for r in reports),
        },
        backend=backend,
    )


def _check_again(job: list[dict[str, Any]], phase: str, backend: str = "sqlite") -> dict[str, Any]:
    """Assert what a second start of both groups must show; return its log row (as above)."""
    _check_groups(job, phase)
    for result in job:
        start = result[phase]
        rep = start["report"]
        assert (rep["status"], rep["loaded"], rep["tuned"], rep["committed"]) == ("warm", ALL, 0, 0)
        assert start["standin"]["profiled"] == 0 and start["standin"]["hits"] == ALL
    return dict(
        item=ITEM,
        test=_nodeid(),
        applied="both 2-rank TP groups of a 4-rank job start again at once on their shared registry",
        outcome="4/4 ranks warm: 18 loaded, 0 profiled, 0 committed",
        ok=True,
        figures={"slowest_start_s": max(r[phase]["report"]["seconds"]["total"] for r in job)},
        backend=backend,
    )


def test_both_groups_commit_the_same_keys_at_once_and_nothing_is_lost(
    job: list[dict[str, Any]],
) -> None:
    row = _check_together(job, "together", "together_commits", "together_stored")
    assert job[0]["together_verify_clean"] is True
    record(**row)


def test_a_second_start_of_both_groups_loads_everything_and_tunes_nothing(
    job: list[dict[str, Any]],
) -> None:
    record(**_check_again(job, "again"))


def test_flashinfers_real_loop_on_each_group(job: list[dict[str, Any]]) -> None:
    # The same two phases through FlashInfer's own choose_one (CUDA timing stood in):
    # its all-reduces (OOM flags, timings, 0.7.4's agreement gates) stay within each group.
    rows = [
        _check_together(job, "fi_together", "fi_commits", "fi_stored"),
        _check_again(job, "fi_again"),
    ]
    assert job[0]["fi_verify_clean"] is True
    for row in rows:
        record(**row)


@pytest.mark.postgres
def test_both_groups_on_one_postgresql_registry(tmp_path: Path, postgres_url: str) -> None:
    job = _run(tmp_path, postgres_url, real_loop=False)
    _check_groups(job, "alone")
    rows = [
        _check_together(job, "together", "together_commits", "together_stored", "postgres"),
        _check_again(job, "again", "postgres"),
    ]
    assert job[0]["together_verify_clean"] is True
    for row in rows:
        record(**row)
