"""v2-mode warm starts (``ficache.v2_mode``) through FlashInfer's real ``autotune_v2``.

2 and 4 real gloo ranks run ``tests/v2_mode_scenarios.py`` (a hard timeout
kills them); only CUDA timing is stood in (``ficache.standin_timing``). CI
runs this file with FlashInfer 0.7.4 (``tox -e test``) and 0.7.2.post1
(``tox -e vllm``). One process covers the bad input: a store whose entry or
protocol entry files change while the start reads it back.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

import pytest
import v2_mode_scenarios
from gloo_scenarios import ALL, GROUP_TIMEOUT, _sql, registry_summary

from ficache._ranks import run_ranks

pytestmark = pytest.mark.slow

#: Hang guard: every rank is killed after this long; never compared with a duration.
HARD_TIMEOUT = 900.0
NAMES = ["pr55671", "ambient"]


@pytest.fixture(scope="module", params=[2, 4], ids=["2-ranks", "4-ranks"])
def ranks(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Any:
    world = request.param
    root = tmp_path_factory.mktemp(f"v2-mode-{world}")
    return run_ranks(
        v2_mode_scenarios.run_plan,
        world,
        str(root),
        NAMES,
        timeout=HARD_TIMEOUT,
        group_timeout=GROUP_TIMEOUT,
    )


def _scenario(ranks: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    out = [r[name] for r in ranks]
    for rank, r in enumerate(out):
        assert "error" not in r, f"{name} failed on rank {rank}:\n{r['error']}"
    return out


@pytest.mark.parametrize("name", NAMES)
def test_cold_commits_every_tuned_entry(ranks: list[dict[str, Any]], name: str) -> None:
    per_rank = _scenario(ranks, name)
    world = len(per_rank)
    for rank, r in enumerate(per_rank):
        cold = r["cold"]
        report = cold["report"]
        assert cold["exception"] is None, cold["exception"]
        assert cold["profiled"] == ALL, (rank, cold["profiled"])
        assert report["status"] == "cold" and report["reason"] is None, report
        assert report["tuned"] == ALL and report["committed"] == ALL
        assert report["shared"] == ALL and report["synchronized"], report
        v2 = report["v2"]
        assert v2 is not None and v2["harvested"] == ALL and v2["root"] == cold["v2_cache_root"]
        assert v2["served"] == 0
        assert r["after_cold"]["scopes"] == {"shared": ALL}
    assert len({r["cold"]["v2_cache_root"] for r in per_rank}) == world  # one root per rank


def test_pr55671_block_is_served_from_ficaches_root(ranks: list[dict[str, Any]]) -> None:
    for rank, r in enumerate(_scenario(ranks, "pr55671")):
        v2 = r["cold"]["report"]["v2"]
        assert len(v2["redirected"]) == 1, v2
        assert v2["redirected"][0].endswith(f"node-local-rank{rank}"), v2
        # The node-local root named by the caller was never written: ficache's root served it.
        node_root = Path(v2["redirected"][0])
        assert not list(node_root.glob("v2/*/entries/*.json")), rank


@pytest.mark.parametrize("name", NAMES)
def test_warm_profiles_nothing(ranks: list[dict[str, Any]], name: str) -> None:
    for r in _scenario(ranks, name):
        warm = r["warm"]
        assert warm["exception"] is None
        assert warm["profiled"] == 0
        report = warm["report"]
        assert report["status"] == "warm" and report["loaded"] == ALL, report
        assert report["tuned"] == 0 and report["committed"] == 0
        assert report["v2"]["served"] == ALL and report["v2"]["harvested"] == 0


@pytest.mark.parametrize("name", NAMES)
def test_half_deleted_re_tunes_exactly_those(ranks: list[dict[str, Any]], name: str) -> None:
    per_rank = _scenario(ranks, name)
    deleted = per_rank[0]["deleted"]
    assert 0 < len(deleted) < ALL
    for r in per_rank:
        half = r["half"]
        assert half["profiled"] == len(deleted), half
        report = half["report"]
        assert report["status"] == "partial" and report["loaded"] == ALL - len(deleted)
        assert report["tuned"] == len(deleted) and report["v2"]["harvested"] == len(deleted)
        assert r["after_half"]["scopes"] == {"shared": ALL}
    assert per_rank[0]["half"]["report"]["committed"] == len(deleted)
    assert sorted(set(per_rank[0]["keys_after_half"])) == per_rank[0]["keys_after_half"]
    assert set(deleted) <= set(per_rank[0]["keys_after_half"])


@pytest.mark.parametrize("name", NAMES)
def test_a_rank_raising_mid_tuning_frees_its_peers(ranks: list[dict[str, Any]], name: str) -> None:
    per_rank = _scenario(ranks, name)
    for rank, r in enumerate(per_rank):
        start = r["raise"]
        report = start["report"]
        assert start["exception"] is not None, (rank, report)
        if rank == 1:
            assert "boom mid-tuning" in start["exception"]
        assert report["committed"] == 0 and report["commit_id"] is None
        assert report["reason"].startswith("nothing committed: rank 1 raised"), report["reason"]
        assert r["after_raise"] == r["before_raise"]
        # The block tuned in v2 mode, from the slice every rank loaded.
        assert report["v2"] is not None, report
        assert report["v2"]["served"] == r["before_raise"]["scopes"]["shared"] == report["loaded"]


def test_an_attached_store_is_replaced_and_reported(ranks: list[dict[str, Any]]) -> None:
    for r in _scenario(ranks, "ambient"):
        report = r["cold"]["report"]
        assert report["v2"]["replaced"] == r["attached_before"], report["v2"]
        assert any("managed store was attached" in w for w in report["warnings"]), report
        # Later starts find ficache's own root attached: nothing to report.
        assert r["warm"]["report"]["v2"]["replaced"] is None


# --------------------------------------------------------------------------
# A block that tunes under its own measurement policy (``v2_mode_scenarios.block_policy``).

#: The manifest fields of ``v2_mode_scenarios.block_policy()``.
BLOCK_POLICY = {"measure_cold_l2": "False"}
POLICY_WARNING = "tuned under another measurement policy"


@pytest.fixture(scope="module")
def policy_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """2 ranks: ``policy_cold`` and ``policy_explicit``, then ``policy_warm`` in fresh
    processes (a fresh store root each; the registry is what carries over)."""
    root = str(tmp_path_factory.mktemp("v2-policy"))
    options = {"timeout": HARD_TIMEOUT, "group_timeout": GROUP_TIMEOUT}
    first = run_ranks(
        v2_mode_scenarios.run_plan, 2, root, ["policy_cold", "policy_explicit"], **options
    )
    second = run_ranks(v2_mode_scenarios.run_plan, 2, root, ["policy_warm"], **options)
    return [{**a, **b} for a, b in zip(first, second, strict=True)]


def test_a_blocks_own_policy_is_adopted_and_committed(policy_ranks: list[dict[str, Any]]) -> None:
    per_rank = _scenario(policy_ranks, "policy_cold")
    for rank, r in enumerate(per_rank):
        cold = r["cold"]
        report = cold["report"]
        assert cold["exception"] is None, cold["exception"]
        assert cold["profiled"] == ALL, (rank, cold["profiled"])
        assert report["status"] == "cold" and report["tuned"] == ALL, report
        assert report["committed"] == ALL and report["shared"] == ALL, report
        v2 = report["v2"]
        assert v2["measurement"] == BLOCK_POLICY, v2
        assert v2["harvested"] == ALL and v2["served"] == 0 and v2["elsewhere"] == 0, v2
        assert not any(POLICY_WARNING in w for w in report["warnings"]), report["warnings"]
        assert r["after_cold"]["scopes"] == {"shared": ALL}
    zero = per_rank[0]
    env_hash = zero["cold"]["report"]["v2"]["env_hash"]
    [commit] = zero["commits"]
    assert commit["provenance"]["v2_mode"]["measurement"] == BLOCK_POLICY
    [environment] = commit["provenance"]["v2_environments"]
    assert environment["measurement"] == BLOCK_POLICY and environment["env_hash"] == env_hash
    assert environment["entries"] == ALL
    # ``export --v2-store`` writes the entries back where that policy's autotune_v2 looks.
    assert zero["exported_measurement"] == BLOCK_POLICY
    assert zero["exported_envs"] == [env_hash]


def test_a_warm_start_under_the_blocks_policy_profiles_nothing(
    policy_ranks: list[dict[str, Any]],
) -> None:
    cold = _scenario(policy_ranks, "policy_cold")
    for rank, r in enumerate(_scenario(policy_ranks, "policy_warm")):
        warm = r["warm"]
        report = warm["report"]
        assert warm["exception"] is None, warm["exception"]
        assert warm["profiled"] == 0, (rank, warm["profiled"])
        assert report["status"] == "warm" and report["loaded"] == ALL, report
        assert report["tuned"] == 0 and report["committed"] == 0, report
        v2 = report["v2"]
        assert v2["measurement"] == BLOCK_POLICY and v2["served"] == ALL, v2
        assert v2["harvested"] == 0 and v2["elsewhere"] == 0 and v2["discarded"] == 0, v2
        assert v2["env_hash"] == cold[rank]["cold"]["report"]["v2"]["env_hash"]
        assert v2["root"] != cold[rank]["cold"]["report"]["v2"]["root"]  # a fresh process
        assert r["after_warm"] == cold[rank]["after_cold"]


def test_an_explicit_policy_is_kept_and_others_are_not_committed(
    policy_ranks: list[dict[str, Any]],
) -> None:
    for rank, r in enumerate(_scenario(policy_ranks, "policy_explicit")):
        cold = r["cold"]
        report = cold["report"]
        assert cold["exception"] is None, cold["exception"]
        assert cold["profiled"] == ALL, (rank, cold["profiled"])
        v2 = report["v2"]
        assert v2["measurement"] == {} and v2["elsewhere"] == ALL and v2["harvested"] == 0, v2
        assert report["committed"] == 0 and report["commit_id"] is None, report
        assert any(POLICY_WARNING in w for w in report["warnings"]), report["warnings"]


@pytest.fixture(scope="module")
def mix_ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    """2 ranks: ``policy_mix`` (two policies in one registry)."""
    root = str(tmp_path_factory.mktemp("v2-policy-mix"))
    return run_ranks(
        v2_mode_scenarios.run_plan,
        2,
        root,
        ["policy_mix"],
        timeout=HARD_TIMEOUT,
        group_timeout=GROUP_TIMEOUT,
    )


def test_two_policies_of_one_environment_are_stored_and_served_apart(
    mix_ranks: list[dict[str, Any]],
) -> None:
    """The default policy's cold start is cold (before ``Fingerprint.measurement`` it was
    served the other policy's entries and committed nothing); each warm start is served
    its own policy's entries: the one whose half was deleted re-tunes exactly that half,
    the other profiles nothing."""
    per_rank = _scenario(mix_ranks, "policy_mix")
    deleted = per_rank[0]["deleted"]
    assert 0 < deleted < ALL
    for rank, r in enumerate(per_rank):
        for name in ("cold_policy", "cold_default", "warm_policy", "warm_default"):
            assert r[name]["exception"] is None, (rank, name, r[name]["exception"])
        cold_policy, cold_default = r["cold_policy"]["report"], r["cold_default"]["report"]
        assert r["cold_policy"]["profiled"] == ALL and cold_policy["committed"] == ALL
        assert r["cold_default"]["profiled"] == ALL, (rank, cold_default)
        assert cold_default["status"] == "cold" and cold_default["committed"] == ALL
        assert cold_policy["fingerprint"] != cold_default["fingerprint"]
        assert cold_policy["v2"]["measurement"] == BLOCK_POLICY
        assert cold_default["v2"]["measurement"] == {}
        [(a, digest_a, measurement_a), (b, digest_b, measurement_b)] = r["fingerprints"]
        assert (digest_a, digest_b) == (cold_policy["fingerprint"], cold_default["fingerprint"])
        assert (json.loads(measurement_a), measurement_b) == (BLOCK_POLICY, None)
        assert r["entries"] == {a: ALL, b: ALL}

        warm_policy, warm_default = r["warm_policy"]["report"], r["warm_default"]["report"]
        assert r["warm_policy"]["profiled"] == 0, (rank, warm_policy)
        assert warm_policy["status"] == "warm" and warm_policy["loaded"] == ALL
        assert warm_policy["fingerprint"] == cold_policy["fingerprint"]
        assert warm_policy["v2"]["served"] == ALL
        assert r["warm_default"]["profiled"] == deleted, (rank, warm_default)
        assert warm_default["loaded"] == ALL - deleted and warm_default["committed"] == deleted
        assert warm_default["fingerprint"] == cold_default["fingerprint"]
        assert warm_default["v2"]["served"] == ALL - deleted
        assert r["entries_after"] == {a: ALL, b: ALL}


# --------------------------------------------------------------------------
# Bad input: a store root that changes while it is read.


def _entry_file(n: int) -> tuple[str, str]:
    """A key FlashInfer could have written (the stand-in's, with a new M) and its file's text."""
    key = (
        "('ficache::cpu_standin_matmul', 'CpuStandInMatmulRunner', "
        f"(({1000 + n}, 128), (128, 128)), (torch.float32,))"
    )
    return key, json.dumps({"key": key, "runner": "CpuStandInMatmulRunner", "tactic": 1})


def _protocol_entry_file(n: int) -> tuple[str, str]:
    """A protocol record's entry key and file, as FlashInfer 0.7.4's
    ``publish_protocol_record(..., persist=True)`` writes one (runner: the namespace)."""
    from ficache.standin_protocol import NAMESPACE
    from ficache.v2_store import protocol_file_key

    key = protocol_file_key(NAMESPACE, json.dumps({"experts": 256, "m": n}))
    return key, json.dumps({"key": key, "runner": NAMESPACE, "tactic": {"tile_n": 128}})


@pytest.mark.parametrize(
    "entry_file", [_entry_file, _protocol_entry_file], ids=["entries", "protocol-records"]
)
def test_a_store_that_changes_while_read_back_is_refused(tmp_path: Path, entry_file: Any) -> None:
    from flashinfer import autotune_v2

    from ficache.standin_timing import real_loop_tune
    from ficache.sync import warm_start
    from ficache.v2_store import entry_file_name

    db = tmp_path / "registry.db"
    with (
        warm_start(None, db=str(db), v2=True, timeout=GROUP_TIMEOUT) as ws,
        autotune_v2(mode="tune", cache_root=tmp_path / "elsewhere"),
    ):
        real_loop_tune()
    assert ws.report.committed == ALL
    before = registry_summary(db)
    stop = threading.Event()
    busy = threading.Event()  # the writer has written a few hundred files, and goes on

    def writer(entries: Path) -> None:
        n = 0
        while not stop.is_set():
            if n == 300:
                busy.set()
            key, text = entry_file(n)
            (entries / entry_file_name(key)).write_text(text)
            n += 1

    with warm_start(None, db=str(db), v2=True, timeout=GROUP_TIMEOUT) as ws:
        root = ws.v2_cache_root
        assert root is not None
        (entries,) = root.glob("v2/*/entries")
        thread = threading.Thread(target=writer, args=(entries,), daemon=True)
        thread.start()
        assert busy.wait(60)  # the start reads the store back while the writer writes
    stop.set()
    thread.join()
    report = ws.report
    assert report.committed == 0 and report.commit_id is None
    assert report.reason is not None and "changed while it was read" in report.reason, report
    assert "\n" not in report.reason
    assert registry_summary(db) == before
    assert _sql(db, "SELECT count(*) FROM protocol_records") == [(0,)]


def test_only_the_first_differing_policy_is_adopted(tmp_path: Path) -> None:
    """One process, v2 mode set up at the block's first ``autotune_v2`` (the ``policy_*``
    scenarios serve the store eagerly, ``v2=True``): that call names ``block_policy()``
    (adopted), a second one another policy (FlashInfer's ``_timer`` override: identity-bearing,
    and timed by the CPU stand-in as the default), whose entries are counted elsewhere, not
    committed."""
    from flashinfer import autotune_v2
    from flashinfer.autotune_cache import MeasurementPolicy

    from ficache.standin import DEFAULT_SHAPES
    from ficache.standin_timing import real_loop_tune
    from ficache.sync import warm_start

    db, node = tmp_path / "registry.db", tmp_path / "node-local"
    first, second = v2_mode_scenarios.block_policy(), MeasurementPolicy(_timer="events")
    # v2 left to the start (``None``): the store is written at the first autotune_v2 call.
    with warm_start(None, db=str(db), timeout=GROUP_TIMEOUT) as ws:
        with autotune_v2(mode="tune", cache_root=node, measurement_policy=first):
            adopted = real_loop_tune(shapes=DEFAULT_SHAPES[:1]).profiled
        with autotune_v2(mode="tune", cache_root=node, measurement_policy=second):
            other = real_loop_tune(shapes=DEFAULT_SHAPES[1:]).profiled
    report = ws.report
    assert (adopted, adopted + other) == (ALL // len(DEFAULT_SHAPES), ALL)
    assert report.v2 is not None and report.v2["measurement"] == BLOCK_POLICY, report.v2
    assert report.committed == adopted and report.v2["harvested"] == adopted
    assert report.v2["elsewhere"] == other
    assert any(POLICY_WARNING in w for w in report.warnings), report.warnings
    assert registry_summary(db)["scopes"] == {"shared": adopted}
