"""Replay mode on 2 gloo ranks, through FlashInfer's REAL ``choose_one``: serve the registry,
never profile, count each miss, commit nothing, the same tactics on every boot.

``tests/flashinfer_loop_scenarios.py`` (``replay``) runs the ranks; only CUDA timing
is stood in (``ficache.standin_timing``). Each boot's block asks FlashInfer for all
18 keys of the stand-in op under ``autotune(True)``, as an engine's warmup does, on
a registry that lost 9 of them. The SQLite and PostgreSQL ``stats`` counts are in
``tests/test_usage.py``; the vLLM plugin's ``FICACHE_MODE`` in
``tests/test_vllm_plugin_hooks.py``.
"""

from __future__ import annotations

import json
from typing import Any

import flashinfer_loop_scenarios
import gloo_scenarios
import pytest
from test_sync import assert_no_timeout

from ficache._ranks import run_ranks

pytestmark = pytest.mark.slow

WORLD = 2
ALL = gloo_scenarios.ALL  # 18 keys
#: Hang guard: both ranks are killed after this long; never compared with a duration.
HARD_TIMEOUT = 600.0


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("replay")
    results = run_ranks(
        flashinfer_loop_scenarios.run_plan,
        WORLD,
        str(root),
        ["replay"],
        timeout=HARD_TIMEOUT,
        group_timeout=gloo_scenarios.GROUP_TIMEOUT,
    )
    out = [r["replay"] for r in results]
    for rank, r in enumerate(out):
        assert "error" not in r, f"rank {rank}:\n{r['error']}"
        assert_no_timeout(r, f"replay rank {rank}")
    return out


def test_a_replay_start_profiles_nothing_and_reports_exactly_the_missing_keys(
    ranks: list[dict[str, Any]],
) -> None:
    stored = {k: json.loads(t) for k, t in ranks[0]["before"]["entries"].items()}
    assert len(stored) == ALL // 2
    for r in ranks:
        assert r["cold"]["report"]["committed"] == ALL
        for boot in ("boot1", "boot2"):
            report, served = r[boot]["report"], r[boot]["serve"]
            assert (report["mode"], report["status"], report["reason"]) == ("replay", "warm", None)
            assert (report["loaded"], report["tuned"], report["missed"]) == (9, 0, 9)
            assert (served["profiled"], served["reduces"]) == (0, 0)  # no timing, no all-reduce
            fell_back = {k for k, t in served["tactics"].items() if t == -1}
            assert len(served["tactics"]) == ALL
            # Exactly the lost half fell back; every stored key got its stored tactic.
            assert fell_back == set(served["tactics"]) - set(stored)
            assert {k: t for k, t in served["tactics"].items() if k in stored} == stored


def test_two_replay_boots_pick_identical_tactics_for_every_key_on_every_rank(
    ranks: list[dict[str, Any]],
) -> None:
    tactics = [r[boot]["serve"]["tactics"] for r in ranks for boot in ("boot1", "boot2")]
    assert all(t == tactics[0] for t in tactics)
    assert len(tactics[0]) == ALL


def test_replay_commits_nothing(ranks: list[dict[str, Any]]) -> None:
    before, after = ranks[0]["before"], ranks[0]["after"]
    assert after["entries"] == before["entries"]
    assert after["commits"] == before["commits"] == 1
    # The served mark counted both replay starts and their misses (rank 0's, once each).
    assert [tuple(c) for c in before["counts"]] == [(0, 0, 0)]
    assert [tuple(c) for c in after["counts"]] == [(2, 2, 18)]
    for r in ranks:
        for boot in ("boot1", "boot2"):
            assert (r[boot]["report"]["committed"], r[boot]["report"]["commit_id"]) == (0, None)


def test_rank_0s_mode_is_every_ranks(ranks: list[dict[str, Any]]) -> None:
    # Rank 0 asked for tune, rank 1 for replay: both tune (no rank profiles alone).
    for r in ranks:
        report, served = r["mixed"]["report"], r["mixed"]["serve"]
        assert (report["mode"], report["status"], report["tuned"]) == ("tune", "partial", 9)
        assert served["profiled"] == 9
    assert ranks[0]["mixed"]["report"]["committed"] == 9
    assert len(ranks[0]["after_mixed"]["entries"]) == ALL
    assert ranks[0]["mixed"]["serve"]["tactics"] == ranks[1]["mixed"]["serve"]["tactics"]
