"""The distributed fault scenarios through FlashInfer's REAL tuning loop, on 2 gloo ranks.

``ficache.standin`` imitates FlashInfer's collective sequence; here the
block tunes through FlashInfer's own ``AutoTuner.choose_one`` instead, with
only CUDA timing stood in (``ficache.standin_timing``: its module docstring
says which function is replaced and why). Every collective FlashInfer
issues while tuning (the out-of-memory flags, the per-tactic timing
all-reduce, and from 0.7.4 on its agreement gates) runs on the real gloo
tuning group, so a deadlock its sequence could cause under ficache's
protocol fails here, on a CPU, instead of on a GPU fleet.

The two ranks run every scenario once (module fixture, a hard timeout);
``tests/flashinfer_loop_scenarios.py`` names them. Behaviour FlashInfer
changed between versions is asserted per version: 0.7.2.post1 (vLLM 0.33's;
``tox -e vllm`` installs it) has no cache-hit agreement, so a rank that
misses where its peer hits blocks in FlashInfer's own OOM-flag all-reduce
and ficache releases it; 0.7.4 agrees on every hit first, so both re-profile.
CI runs this file in both envs: ``tox -e test`` (FlashInfer 0.7.4) and
``tox -e vllm`` (0.7.2.post1), so each version's branch runs on its own
release; a test of the other version's branch is skipped, naming the env
that runs it.
"""

from __future__ import annotations

import os
import re
from typing import Any

import flashinfer
import flashinfer.autotuner.autotuner as fi_autotuner
import flashinfer_loop_scenarios
import gloo_scenarios
import pytest
from reliability_log import record
from test_sync import assert_no_timeout

from ficache._ranks import run_ranks

pytestmark = pytest.mark.slow

ITEM = "FlashInfer's real tuning loop"
WORLD = 2
ALL = gloo_scenarios.ALL  # 18 keys
#: Hang guard: both ranks are killed after this long (a run takes 30-60 s); never
#: compared with a duration.
HARD_TIMEOUT = 600.0
NAMES = [
    "cold_warm",
    "partial",
    "per_rank_keys",
    "disagree",
    "locked",
    "load_fails",
    "heterogeneous",
    "raise_after",
    "raise_before",
    "stuck_peer",
    "tactic_fails",
    "oom_one_rank",
]
#: FlashInfer 0.7.4 added group agreement gates (operation, profiles, cache hits).
GATES = hasattr(fi_autotuner, "_all_ranks_hit_cache")
#: Why a test of the other version's branch is skipped here: CI runs it in the other env.
ON_074 = "has the cache-hit gate: this 0.7.2 test runs in `tox -e vllm` (0.7.2.post1)"
ON_072 = "has no cache-hit gate: this 0.7.4 test runs in `tox -e test`"


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, dict[str, Any]]]:
    root = tmp_path_factory.mktemp("flashinfer-loop")
    return run_ranks(
        flashinfer_loop_scenarios.run_plan,
        WORLD,
        str(root),
        NAMES,
        timeout=HARD_TIMEOUT,
        group_timeout=gloo_scenarios.GROUP_TIMEOUT,
    )


def scenario(ranks: list[dict[str, dict[str, Any]]], name: str) -> list[dict[str, Any]]:
    out = [r[name] for r in ranks]
    for rank, r in enumerate(out):
        assert "error" not in r, f"scenario {name} failed on rank {rank}:\n{r['error']}"
        assert_no_timeout(r, f"{name} rank {rank}")
    return out


def _nodeid() -> str:
    """The running test's node id (``tests/test_x.py::test_y``), as RELIABILITY.md names it."""
    return os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0]


def _record(name: str, applied: str, outcome: str, per_rank: list[dict[str, Any]]) -> None:
    record(
        item=ITEM,
        test=_nodeid(),
        applied=f"{applied} (FlashInfer {flashinfer.__version__} choose_one, 2 gloo ranks)",
        outcome=outcome,
        ok=True,
        figures={"slowest_rank_s": round(max(r["seconds"] for r in per_rank), 3)},
    )


def _start(r: dict[str, Any], phase: str) -> tuple[dict[str, Any], dict[str, Any]]:
    return r[phase]["report"], r[phase]["standin"]


def test_cold_warm_half_through_flashinfers_loop(ranks: list[dict[str, Any]]) -> None:
    per_rank = scenario(ranks, "cold_warm")
    for r in per_rank:
        cold, loop = _start(r, "cold")
        assert (cold["status"], cold["tuned"], cold["committed"], cold["shared"]) == (
            "cold",
            ALL,
            ALL,
            ALL,
        )
        assert loop["profiled"] == ALL and loop["reduces"] > 0  # FlashInfer's own all-reduces
        warm, loop = _start(r, "warm")
        assert (warm["status"], warm["loaded"], warm["tuned"], warm["committed"]) == (
            "warm",
            ALL,
            0,
            0,
        )
        assert loop["profiled"] == 0 and loop["hits"] == ALL
        # 0.7.2: a warm start issues no collective; 0.7.4 still agrees on every hit.
        assert (loop["reduces"] > 0) is GATES
        half, loop = _start(r, "half")
        assert (half["status"], half["loaded"], half["tuned"], half["committed"]) == (
            "partial",
            ALL // 2,
            ALL // 2,
            ALL // 2,
        )
        assert loop["profiled"] == ALL // 2
    assert per_rank[0]["cold"]["entries"] == per_rank[1]["cold"]["entries"]
    assert per_rank[0]["registry"] == {"commits": 2, "scopes": {"shared": ALL}}
    _record(
        "cold_warm",
        "cold start, warm start, then half the entries deleted",
        "18 committed shared; warm loads 18 and profiles 0; half tunes exactly 9",
        per_rank,
    )


def test_partial_and_per_rank_keys(ranks: list[dict[str, Any]]) -> None:
    partial = scenario(ranks, "partial")
    for r in partial:
        rep, loop = _start(r, "second")
        assert (rep["loaded"], rep["tuned"], rep["committed"]) == (12, 6, 6)
        assert loop["profiled"] == 6
    per_rank = scenario(ranks, "per_rank_keys")
    assert per_rank[0]["registry"]["scopes"] == {f"world2/rank{r}": ALL for r in range(WORLD)}
    for rank, r in enumerate(per_rank):
        rep, loop = _start(r, "second")
        assert (rep["status"], rep["loaded"], rep["tuned"]) == ("warm", ALL, 0)
        assert all(f"'rank{rank}'" in key for key in r["second"]["entries"])
    _record(
        "partial+per_rank_keys",
        "a partial start, and keys that name the rank",
        "only the missing 6 tuned; 18 per rank scoped, each rank loads its own",
        partial + per_rank,
    )


def test_ranks_whose_own_timings_disagree_pick_one_tactic(ranks: list[dict[str, Any]]) -> None:
    # Each rank's timer favours a different tactic (5 ms charged to every other one):
    # FlashInfer all-reduces the timings, so every rank picks the same tactic and
    # ficache stores each entry once, shared.
    per_rank = scenario(ranks, "disagree")
    for r in per_rank:
        rep, _loop = _start(r, "first")
        assert rep["disagreements"] == 0 and rep["shared"] == ALL and rep["scoped"] == 0
    assert per_rank[0]["first"]["entries"] == per_rank[1]["first"]["entries"]
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": ALL}}
    _record(
        "disagree",
        "each rank's own timings favour a different tactic",
        "0 disagreements: 18 entries shared",
        per_rank,
    )


def test_registry_faults_through_flashinfers_loop(ranks: list[dict[str, Any]]) -> None:
    locked = scenario(ranks, "locked")
    for r in locked:
        rep, _ = _start(r, "first")
        assert (rep["loaded"], rep["tuned"], rep["committed"]) == (12, 6, 0)
        assert "locked" in rep["reason"]
    assert locked[0]["registry"] == {"commits": 1, "scopes": {"shared": 12}}
    for name, fragment in (
        ("load_fails", "injected load failure"),
        ("heterogeneous", "different environments"),
    ):
        per_rank = scenario(ranks, name)
        for r in per_rank:
            rep, loop = _start(r, "first")
            assert rep["status"] == "uncached" and fragment in rep["reason"]
            assert rep["committed"] == 0 and loop["profiled"] == ALL
        assert per_rank[0]["first"]["entries"] == per_rank[1]["first"]["entries"]
        assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": ALL}}
    _record(
        "locked+load_fails+heterogeneous",
        "a held write lock; a rank whose load fails; ranks of different fingerprints",
        "every start ends, tunes uncached or commits nothing, one reason on every rank",
        locked,
    )


def test_a_rank_that_raises_in_the_block(ranks: list[dict[str, Any]]) -> None:
    after = scenario(ranks, "raise_after")
    assert [r["first"]["exception"] for r in after] == [None, "ValueError: boom"]
    assert after[0]["registry"] == {"commits": 0, "scopes": {}}
    before = scenario(ranks, "raise_before")
    assert before[1]["first"]["exception"] == "ValueError: boom"
    # Rank 0 was inside FlashInfer's loop, in one of its all-reduces with rank 1: released.
    assert re.search("Connection (closed|reset) by peer", before[0]["first"]["exception"])
    for r in before:
        assert r["first"]["report"]["reason"].startswith("nothing committed: rank 1 raised")
        assert r["after"]["report"]["committed"] == ALL  # the next start works
    _record(
        "raise_after+raise_before",
        "rank 1 raises after tuning, and before tuning while rank 0 tunes",
        "nothing committed; rank 0 released from FlashInfer's all-reduce; next start commits 18",
        after + before,
    )


@pytest.mark.skipif(GATES, reason=f"FlashInfer {flashinfer.__version__} {ON_074}")
def test_a_rank_that_misses_where_its_peer_hits_is_released_on_0_7_2(
    ranks: list[dict[str, Any]],
) -> None:
    per_rank = scenario(ranks, "stuck_peer")
    # Rank 1 blocks in FlashInfer's out-of-memory-flag all-reduce; rank 0 hit
    # everything and left its block, then released the tuning group.
    assert per_rank[0]["first"]["exception"] is None
    assert re.search("Connection (closed|reset) by peer", per_rank[1]["first"]["exception"])
    for r in per_rank:
        assert r["first"]["report"]["committed"] == 0
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": ALL}}
    outcome = "rank 1 blocked in FlashInfer's OOM-flag all-reduce, released after 1 s grace"
    _record("stuck_peer", "rank 1 loses its loaded cache inside the block", outcome, per_rank)


@pytest.mark.skipif(not GATES, reason=f"FlashInfer {flashinfer.__version__} {ON_072}")
def test_a_rank_that_misses_where_its_peer_hits_re_profiles_on_0_7_4(
    ranks: list[dict[str, Any]],
) -> None:
    per_rank = scenario(ranks, "stuck_peer")
    # FlashInfer's cache-hit gate: any miss makes every rank re-profile, in lockstep.
    assert [r["first"]["exception"] for r in per_rank] == [None, None]
    for r in per_rank:
        rep, loop = _start(r, "first")
        assert loop["profiled"] == ALL and rep["reason"] is None
    assert per_rank[0]["registry"] == {"commits": 1, "scopes": {"shared": ALL}}
    outcome = "0.7.4's hit gate: both ranks re-profile; no failure"
    _record("stuck_peer", "rank 1 loses its loaded cache inside the block", outcome, per_rank)


def test_a_tactic_that_fails_on_one_rank_is_picked_by_none(ranks: list[dict[str, Any]]) -> None:
    per_rank = scenario(ranks, "tactic_fails")
    for r in per_rank:
        rep, loop = _start(r, "first")
        assert (rep["committed"], rep["shared"], rep["disagreements"]) == (ALL, ALL, 0)
        assert r["first"]["exception"] is None
        assert "0" not in {row[1] for row in r["first"]["entries"].values()}
    assert per_rank[0]["first"]["entries"] == per_rank[1]["first"]["entries"]
    _record(
        "tactic_fails",
        "tactic 0 raises on rank 1 whenever it is timed",
        "FlashInfer reduces inf and skips it on both ranks: 18 shared, none with tactic 0",
        per_rank,
    )


def test_out_of_memory_on_one_rank_falls_back_on_every_rank(ranks: list[dict[str, Any]]) -> None:
    per_rank = scenario(ranks, "oom_one_rank")
    for r in per_rank:
        rep, loop = _start(r, "first")
        # FlashInfer all-reduced rank 1's OOM flag: both ranks fell back for that shape.
        assert loop["fallbacks"] == 1 and loop["profiled"] == 12
        assert (rep["tuned"], rep["committed"], rep["shared"]) == (12, 12, 12)
        assert r["registry"] == {"commits": 1, "scopes": {"shared": 12}}
        rep, loop = _start(r, "second")
        assert (rep["loaded"], rep["tuned"], rep["committed"]) == (12, 6, 6)
        assert loop["profiled"] == 6 and loop["fallbacks"] == 0
    assert per_rank[0]["first"]["entries"] == per_rank[1]["first"]["entries"]
    assert per_rank[0]["registry_after"] == {"commits": 2, "scopes": {"shared": ALL}}
    _record(
        "oom_one_rank",
        "rank 1 runs out of memory preparing one of 3 weight shapes",
        "both ranks fall back for that shape (12 committed); the next start tunes the 6",
        per_rank,
    )
