"""The vLLM plugin against real vLLM 0.33 (run with ``tox -e vllm``; skipped without vLLM).

Two processes per scenario (``tests/vllm_ranks.py``, under a hard timeout)
run vLLM's real ``init_distributed_environment`` over gloo and its real
``GroupCoordinator`` groups, load the plugin through vLLM's own
``load_general_plugins()`` (the installed ``vllm.general_plugins`` entry
point), and call vLLM's real ``kernel_warmup.flashinfer_autotune`` as its
worker does. The model runner is the one stand-in: its dummy run fills the
real AutoTuner's cache the way FlashInfer tuning would (see
``tests/vllm_ranks.py``).

Importing vLLM costs 15-25 s per process, so each scenario's processes run
once (module-scoped fixtures) and every step of it is asserted by the
tests below.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

# Only look: importing vLLM here would cost this process 15-25 s; the ranks import it.
if importlib.util.find_spec("vllm") is None:
    pytest.skip(
        "needs vLLM 0.33 installed (run `tox -e vllm`, which installs it)",
        allow_module_level=True,
    )

from reliability_log import record  # noqa: E402
from vllm_ranks import PROBE_KEY  # noqa: E402

from ficache._ranks import free_port  # noqa: E402
from ficache.registry import Registry  # noqa: E402
from ficache.standin import DEFAULT_BUCKETS, DEFAULT_SHAPES  # noqa: E402

pytestmark = pytest.mark.vllm

RANKS_SCRIPT = Path(__file__).with_name("vllm_ranks.py")
WORLD = 2
N = len(DEFAULT_SHAPES) * len(DEFAULT_BUCKETS)  # keys the stand-in tunes: 18
#: Importing vLLM takes 15-25 s per process on a small CPU box.
TIMEOUT = float(os.environ.get("FICACHE_VLLM_TEST_TIMEOUT", "300"))


def run_scenario(
    scenario: str, tmp: Path, env: dict[str, str | None], world: int = WORLD
) -> list[dict[str, Any]]:
    """Start ``world`` rank processes; kill them all if they outlast TIMEOUT; return their results."""
    tmp.mkdir(parents=True, exist_ok=True)
    full_env = dict(os.environ)
    full_env.update(
        {
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CACHE_ROOT": str(tmp / "vllm-cache"),
            "XDG_CACHE_HOME": str(tmp / "user-cache"),
            # FlashInfer's default v2 store root (the plugin adopts from it): not ~/.cache.
            "FLASHINFER_AUTOTUNE_CACHE_DIR": str(tmp / "flashinfer-autotune"),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    for name in (
        "FICACHE_DB",
        "FICACHE_VLLM",
        "FICACHE_ADOPT",
        "VLLM_PLUGINS",
        "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR",
    ):
        full_env.pop(name, None)
    for key, value in env.items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    port = free_port()
    logs = [open(tmp / f"rank{r}.log", "w") for r in range(world)]  # noqa: SIM115
    procs = []
    started = time.monotonic()
    try:
        for rank in range(world):
            procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        str(RANKS_SCRIPT),
                        scenario,
                        str(rank),
                        str(world),
                        str(port),
                        str(tmp),
                    ],
                    env=full_env,
                    stdout=logs[rank],
                    stderr=subprocess.STDOUT,
                )
            )
        limit = TIMEOUT * max(world // WORLD, 1)  # 4 ranks import vLLM on the same cores
        deadline = started + limit
        for proc in procs:
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                break
        stuck = [r for r, p in enumerate(procs) if p.poll() is None]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        for log in logs:
            log.close()
    elapsed = time.monotonic() - started

    def tail(rank: int) -> str:
        return (tmp / f"rank{rank}.log").read_text()[-4000:]

    if stuck:
        pytest.fail(
            f"{scenario}: rank(s) {stuck} still running after {limit:g} s; killed.\n"
            + "\n".join(f"--- rank {r} ---\n{tail(r)}" for r in stuck)
        )
    results = []
    for rank in range(world):
        path = tmp / f"rank{rank}.json"
        if not path.exists():
            pytest.fail(f"{scenario}: rank {rank} wrote no result\n{tail(rank)}")
        result = json.loads(path.read_text())
        if result.get("error") or procs[rank].returncode != 0:
            pytest.fail(f"{scenario}: rank {rank} failed:\n{result.get('error')}\n{tail(rank)}")
        result["wall_seconds"] = round(elapsed, 1)
        results.append(result)
    return results


@pytest.fixture(scope="module")
def plugin_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("vllm-plugin")
    registry = tmp / "registry.db"
    return run_scenario("plugin", tmp, {"FICACHE_DB": str(registry)}), tmp


@pytest.fixture(scope="module")
def off_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("vllm-off")
    registry = tmp / "registry.db"
    return run_scenario("off", tmp, {"FICACHE_DB": str(registry), "FICACHE_VLLM": "0"}), tmp


@pytest.fixture(scope="module")
def replay_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("vllm-replay")
    registry = tmp / "registry.db"
    return run_scenario("replay", tmp, {"FICACHE_DB": str(registry), "FICACHE_MODE": None}), tmp


def steps(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r["steps"][name] for r in results]


def wrote_vllm_file(step: dict[str, Any], rank: int) -> bool:
    """vLLM's own per-rank autotune file exists under VLLM_CACHE_ROOT after the step."""
    name = f"autotune_configs_dp0_rank{rank}.json"
    return any(Path(f).name == name for f in step["vllm_cache_files"])


def ficache_warnings(step: dict[str, Any], logger: str = "ficache.vllm") -> list[str]:
    return [
        r["message"] for r in step["records"] if r["logger"] == logger and r["level"] == "WARNING"
    ]


# --------------------------------------------------------------------------
# (a) the plugin on


def test_plugin_patches_kernel_warmup_imported_before_or_after_loading(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, _ = plugin_run
    before, after = results
    # Rank 0 imported kernel_warmup before load_general_plugins(): patched in place.
    assert before["kw_imported_before_plugins"] is True
    # Rank 1 had not: the import hook patched it when it was first imported.
    assert after["kw_imported_before_plugins"] is False
    assert after["kw_in_modules_before_import"] is False
    assert after["finder_installed"] is True
    for result in results:
        patch = result["patch"]
        assert patch["wrapped"] is True
        assert patch["code_file"] == "vllm_plugin.py"  # the wrapper's code
        assert patch["original_is_vllms"] is True


def test_start1_commits_start2_loads_everything_and_tunes_nothing(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, tmp = plugin_run
    for rank, (first, second) in enumerate(
        zip(steps(results, "start1"), steps(results, "start2"), strict=True)
    ):
        assert first["exception"] is None and second["exception"] is None
        # vLLM ran its dummy run under FlashInfer's tuning mode, all-reducing over
        # both ranks (its tune group's cpu_group).
        assert first["dummy_runs"] and all(
            d["tuning_mode"] and d["group_size"] == WORLD for d in first["dummy_runs"]
        )
        assert first["profiled"] == N and first["hits"] == 0
        r1 = first["report"]
        assert r1["status"] == "cold"
        assert (r1["rank"], r1["world_size"], r1["layout"]) == (rank, WORLD, "tp2-pp1-dp1-ep1")
        assert r1["loaded"] == 0 and r1["tuned"] == N
        assert r1["committed"] == N and r1["commit_id"] is not None and r1["shared"] == N
        assert first["entries"] == N
        # Start 2: a restarted server (the AutoTuner cleared) loads all N from the
        # registry; the stand-in finds every key and profiles none; nothing committed.
        assert second["profiled"] == 0 and second["hits"] == N
        r2 = second["report"]
        assert r2["status"] == "warm" and r2["reason"] is None
        assert r2["loaded"] == N and r2["tuned"] == 0
        assert r2["committed"] == 0 and r2["commit_id"] is None
        assert second["entries"] == N
        assert not ficache_warnings(first) and not ficache_warnings(second)

    with Registry.open(str(tmp / "registry.db"), create=False) as reg:
        commits = reg.log(limit=None)
    assert len(commits) == 1  # start 2 (and the fallbacks below) committed nothing
    commit = commits[0]
    assert commit.kind == "startup" and commit.added == N
    assert commit.world_size == WORLD and commit.layout == "tp2-pp1-dp1-ep1"
    provenance = commit.provenance
    assert provenance["layout"] == "tp2-pp1-dp1-ep1"
    assert provenance["framework"] == "vllm"
    assert provenance["vllm_version"] == "0.33.0"
    assert isinstance(provenance["vllm_config_hash"], str) and provenance["vllm_config_hash"]


def test_both_ranks_end_every_start_with_identical_caches(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, _ = plugin_run
    # Each rank all-gathered its AutoTuner's save_configs entries (no _metadata or
    # _generation) after every start and compared them with the other rank's.
    for name in ("start1", "start2", "runtime_off", "unsupported", "db_dir", "db_garbage"):
        for step in steps(results, name):
            assert step["identical_across_ranks"] is True, name
            assert step["entries"] == N, name


def test_vllm_own_file_cache_is_not_used_under_ficache(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    # Under the plugin vLLM's per-rank file is pointed into a scratch directory
    # made for each start: vLLM writes nothing under VLLM_CACHE_ROOT (not even
    # its cache directory), so it could not load a cache of its own on the next
    # start either, and every rank starts from exactly what ficache loaded.
    results, _ = plugin_run
    for name in ("start1", "start2"):
        for step in steps(results, name):
            assert step["vllm_cache_exists"] is False, name
            assert step["vllm_cache_files"] == [], name


def test_runtime_switch_off_hands_the_call_to_vllm(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    # FICACHE_VLLM=0 set after the patch: the wrapper calls vLLM's function as is;
    # vLLM tunes and writes its own per-rank file, ficache starts nothing.
    results, _ = plugin_run
    for rank, step in enumerate(steps(results, "runtime_off")):
        assert step["exception"] is None
        assert step["report"] is None
        assert step["profiled"] == N
        assert wrote_vllm_file(step, rank)
        assert step["records"] == []


# --------------------------------------------------------------------------
# (c) an unsupported vLLM shape


def test_unsupported_vllm_runs_vllms_own_function_with_one_warning(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, _ = plugin_run
    for rank, step in enumerate(steps(results, "unsupported")):
        assert step["exception"] is None
        assert step["report"] is None  # no warm start: nothing loaded, nothing committed
        warnings = ficache_warnings(step)
        assert len(warnings) == 1, step["records"]
        assert "resolve_rank_flashinfer_autotune_file" in warnings[0]
        assert "unchanged" in warnings[0]
        # vLLM's own path: it tuned from empty (its per-rank file was removed first)
        # and wrote its per-rank file under VLLM_CACHE_ROOT.
        assert step["profiled"] == N
        assert wrote_vllm_file(step, rank)


# --------------------------------------------------------------------------
# Adopting what vLLM already tuned (ficache.adopt)


def adoption_lines(step: dict[str, Any]) -> list[str]:
    return [
        r["message"]
        for r in step["records"]
        if r["logger"] == "ficache.vllm" and "adopt" in r["message"]
    ]


def test_empty_registry_adopts_vllms_own_cache_and_profiles_nothing(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    # vLLM 0.33 wrote one file per rank (in `unsupported`, tuning without ficache);
    # each rank added a probe entry whose tactic is its rank. A start on an empty
    # registry: rank 0 adopted both files before its export, every rank loaded all
    # of it, the stand-in profiled nothing, and vLLM's files were left as they were.
    results, tmp = plugin_run
    vllm_files = [f for f in results[0]["adopt_tree"] if Path(f).name.startswith("autotune_")]
    assert [Path(f).name for f in vllm_files] == [
        "autotune_configs_dp0_rank0.json",
        "autotune_configs_dp0_rank1.json",
    ]
    for rank, step in enumerate(steps(results, "adopt")):
        assert step["exception"] is None
        report = step["report"]
        assert report["status"] == "warm" and report["reason"] is None, report
        assert report["loaded"] == N + 1 and report["tuned"] == 0 and report["committed"] == 0
        assert step["profiled"] == 0 and step["hits"] == N
        assert step["probe"] == ["CpuStandInMatmulRunner", str(rank), None]  # its own scope
        assert step["vllm_cache_files"] == results[0]["adopt_tree"]
        assert not ficache_warnings(step)
        expected = [
            f"ficache: adopted vLLM's FlashInfer autotune caches into the registry: {N + 2} "
            f"entries ({N} shared, 2 scoped) from 2 file(s) in 1 layout(s) and 0 v2 "
            f"environment(s), {N + 2} added (commit 1); skipped 0"
        ]
        assert adoption_lines(step) == (expected if rank == 0 else [])
    assert all(r["adopt_tree_unchanged"] is True for r in results)

    with Registry.open(str(tmp / "adopt.db"), create=False) as reg:
        commits = reg.log(limit=None)
        scopes = {(e.scope, e.key): e.tactic_json for e in reg.entries()}
    assert len(commits) == 1  # the adoption; the warm start tuned nothing
    commit = commits[0]
    assert commit.kind == "import" and commit.added == N + 2
    provenance = commit.provenance
    assert provenance["source"] == "vllm-cache"
    assert provenance["framework"] == "vllm" and provenance["vllm_version"] == "0.33.0"
    (layout,) = provenance["layouts"]
    assert Path(layout["directory"]).relative_to(tmp / "vllm-cache")
    assert (layout["kind"], layout["layout"], layout["files"]) == (
        "per rank",
        "tp2-pp1-dp1-ep1",
        ["autotune_configs_dp0_rank0.json", "autotune_configs_dp0_rank1.json"],
    )
    assert (layout["shared"], layout["scoped"], layout["skipped"]) == (N, 2, 0)
    assert sum(scope == "shared" for scope, _key in scopes) == N
    assert {k: v for k, v in scopes.items() if k[0] != "shared"} == {
        ("tp2-pp1-dp1-ep1/rank0", PROBE_KEY): "0",
        ("tp2-pp1-dp1-ep1/rank1", PROBE_KEY): "1",
    }


def test_adoption_happens_once_and_ficache_adopt_0_turns_it_off(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, tmp = plugin_run
    # The next start finds entries for its fingerprint: no adoption, a warm start.
    for rank, step in enumerate(steps(results, "adopt_again")):
        assert adoption_lines(step) == []
        assert step["report"]["status"] == "warm" and step["report"]["loaded"] == N + 1
        assert step["profiled"] == 0
        assert step["probe"] == ["CpuStandInMatmulRunner", str(rank), None]
    # FICACHE_ADOPT=0 on an empty registry: vLLM's files are ignored and it tunes.
    for step in steps(results, "adopt_off"):
        assert adoption_lines(step) == []
        assert step["report"]["status"] == "cold" and step["report"]["loaded"] == 0
        assert step["profiled"] == N and step["probe"] is None
    with Registry.open(str(tmp / "adopt.db"), create=False) as reg:
        assert len(reg.log(limit=None)) == 1
    with Registry.open(str(tmp / "adopt-off.db"), create=False) as reg:
        assert [c.kind for c in reg.log(limit=None)] == ["startup"]


# --------------------------------------------------------------------------
# (d) a registry that cannot be used never stops the start


@pytest.mark.parametrize("name", ["db_dir", "db_garbage"])
def test_unusable_registry_tunes_uncached_on_both_ranks(
    plugin_run: tuple[list[dict[str, Any]], Path], name: str
) -> None:
    results, _ = plugin_run
    for step in steps(results, name):
        assert step["exception"] is None
        report = step["report"]
        assert (report["status"], bool(report["reason"])) == ("uncached", True), report
        assert report["loaded"] == 0 and report["committed"] == 0
        assert step["profiled"] == N  # vLLM tuned everything itself


# --------------------------------------------------------------------------
# (b) FICACHE_VLLM=0 from the start


def test_switched_off_plugin_leaves_vllm_alone(off_run: tuple[list[dict[str, Any]], Path]) -> None:
    results, tmp = off_run
    for rank, result in enumerate(results):
        assert result["finder_installed"] is False
        patch = result["patch"]
        assert patch["wrapped"] is False
        # vLLM's own function object, the very one imported before the plugins loaded
        assert patch["unwrapped_is_vllms"] is True and patch["same_object_as_before"] is True
        step = result["steps"]["start"]
        assert step["exception"] is None
        assert step["report"] is None and step["records"] == []
        assert step["profiled"] == N and step["identical_across_ranks"] is True
        assert wrote_vllm_file(step, rank)
    assert not (tmp / "registry.db").exists()


# --------------------------------------------------------------------------
# A rank that fails in the middle of tuning


def test_failing_rank_fails_both_ranks_at_once_and_commits_nothing(
    plugin_run: tuple[list[dict[str, Any]], Path],
) -> None:
    # Rank 1's dummy run raised after one shape while rank 0 went on to its next
    # tuning all-reduce. The wrapper re-raised at once on rank 1 (no exit
    # protocol on the group vLLM was still using); its process then ended, as a
    # vLLM worker does, and rank 0's all-reduce failed because its peer was
    # gone, not because it waited out the group's 60 s timeout (gloo says
    # "timed out" / "timeout" for that).
    results, tmp = plugin_run
    rank0, rank1 = steps(results, "rank1_fails")
    assert rank1["exception"].startswith("RuntimeError: injected failure in the dummy run")
    assert rank0["exception"] is not None and "injected" not in rank0["exception"]
    first_line = rank0["exception"].splitlines()[0].lower()
    assert "timed out" not in first_line and "timeout" not in first_line, first_line
    for step in (rank0, rank1):
        assert step["report"] is None  # abandoned: no exit protocol
        errors = [r["message"] for r in step["records"] if r["level"] == "ERROR"]
        assert any("abandoned, nothing is committed" in m for m in errors), step["records"]
    with Registry.open(str(tmp / "fails.db"), create=False) as reg:
        assert reg.log(limit=None) == []


# --------------------------------------------------------------------------
# Pipeline parallelism 2: each stage's TP group warm-starts on its own


PP_WORLD = 4  # tp2 x pp2: vLLM's TP groups {0, 1} and {2, 3}
PP_LAYOUT = "tp2-pp2-dp1-ep1"


@pytest.fixture(scope="module")
def pp2_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("vllm-pp2")
    registry = tmp / "registry.db"
    return run_scenario("pp2", tmp, {"FICACHE_DB": str(registry)}, world=PP_WORLD), tmp


def test_pp2_each_tp_group_warm_starts_with_its_own_leader(
    pp2_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, tmp = pp2_run
    for global_rank, result in enumerate(results):
        assert result["start1_met"] is True  # both stages tuned before either committed
        groups = result["groups"]
        stage = global_rank // 2
        assert groups["global_rank"] == global_rank
        assert groups["tp_ranks"] == [2 * stage, 2 * stage + 1]
        assert groups["tp_rank"] == global_rank % 2 and groups["pp_rank"] == stage
        first, second = result["steps"]["start1"], result["steps"]["start2"]
        assert first["exception"] is None and second["exception"] is None
        # vLLM tuned on the TP group (2 ranks), ficache warm-started on that same group:
        # the report's rank is the rank within the TP group.
        assert first["dummy_runs"] and all(
            d["tuning_mode"] and d["group_size"] == 2 for d in first["dummy_runs"]
        )
        r1, r2 = first["report"], second["report"]
        assert (r1["rank"], r1["world_size"], r1["layout"]) == (global_rank % 2, 2, PP_LAYOUT)
        assert r1["status"] == "cold" and r1["tuned"] == N and first["profiled"] == N
        assert r1["synchronized"] is True and r1["reason"] is None
        # Restarted: every rank of both stages loads all N and profiles none.
        assert (r2["status"], r2["loaded"], r2["tuned"], r2["committed"]) == ("warm", N, 0, 0)
        assert second["profiled"] == 0 and second["hits"] == N
        assert first["identical_across_ranks"] is True
        assert second["identical_across_ranks"] is True
        assert not ficache_warnings(second)
    # Both stages committed at once into one registry: the first commit holds all N
    # shared entries (its stage's leader: global rank 0 or 2); the other stage wrote
    # nothing new (equal values) or kept its differing values out (report.kept).
    leaders = [results[0]["steps"]["start1"]["report"], results[2]["steps"]["start1"]["report"]]
    assert sorted(r["committed"] for r in leaders) == [0, N]
    with Registry.open(str(tmp / "registry.db"), create=False) as reg:
        commits = reg.log(limit=None)
        entries = list(reg.entries())
    scopes = {e.scope for e in entries}
    stored = len(entries)
    assert [(c.kind, c.added, c.world_size, c.layout) for c in commits] == [
        ("startup", N, 2, PP_LAYOUT)
    ]
    assert commits[0].provenance["layout"] == PP_LAYOUT
    assert scopes == {"shared"} and stored == N
    record(
        item="groups smaller than the world",
        test=os.environ.get("PYTEST_CURRENT_TEST", "").split(" ")[0],
        applied="vLLM 0.33 plugin, tp2 x pp2 on 4 gloo ranks: both TP groups start cold at once, then restart",
        outcome=f"1 commit of {N} shared ({PP_LAYOUT}); restart: 4/4 ranks warm, 0 profiled",
        ok=True,
        figures={"wall_s": results[0]["wall_seconds"]},
    )


# --------------------------------------------------------------------------
# FICACHE_MODE=replay: vLLM's real flashinfer_autotune, FlashInfer's real choose_one


def test_replay_mode_serves_the_registry_profiles_nothing_and_commits_nothing(
    replay_run: tuple[list[dict[str, Any]], Path],
) -> None:
    # vLLM's own autotune() sets its tuning buckets: start1 tunes more keys than the 18
    # the dummy run asks for; half of what it committed is deleted.
    results, _ = replay_run
    kept = {k: json.loads(t) for k, t in results[0]["kept"].items()}
    committed = results[0]["steps"]["start1"]["report"]["committed"]
    assert len(kept) == committed - committed // 2
    for rank, result in enumerate(results):
        start1 = result["steps"]["start1"]
        assert (start1["report"]["mode"], start1["exception"]) == ("tune", None)
        asked = set(start1["tactics"])
        assert len(asked) == N
        lost = asked - set(kept)
        assert 0 < len(lost) < N
        for name in ("replay1", "replay2"):
            step = result["steps"][name]
            report = step["report"]
            assert step["exception"] is None, step["exception"]
            assert (report["mode"], report["loaded"], report["tuned"]) == ("replay", len(kept), 0)
            assert (report["missed"], report["committed"]) == (len(lost), 0)
            assert (step["profiled"], step["reduces"]) == (0, 0), rank
            tactics = step["tactics"]
            # Each asked key the registry holds got its tactic; each lost one the fallback.
            assert {k: t for k, t in tactics.items() if k in kept} == {
                k: kept[k] for k in asked & set(kept)
            }
            assert {k for k, t in tactics.items() if t == -1} == lost
            lines = [
                r["message"]
                for r in step["records"]
                if r["logger"] == "ficache.vllm" and r["level"] == "INFO"
            ]
            assert any(
                f"replay start on rank {rank}/2" in line and f"missed {len(lost)}" in line
                for line in lines
            ), lines
        # Both boots, both ranks: the same tactic for every key.
        assert result["steps"]["replay1"]["tactics"] == result["steps"]["replay2"]["tactics"]
        assert result["steps"]["replay1"]["tactics"] == results[0]["steps"]["replay1"]["tactics"]
    assert results[0]["commits"] == 1
    lost0 = set(results[0]["steps"]["start1"]["tactics"]) - set(kept)
    assert [tuple(c) for c in results[0]["counts"]] == [(2, 2, 2 * len(lost0))]


# FlashInfer's managed store (v2 mode, ``ficache.v2_mode``): vLLM 0.33's own world-1
# v2 path, and a stand-in for vLLM PR #55671's warmup (``tests/vllm_pr55671.py``).


@pytest.fixture(scope="module")
def v2w1_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("vllm-v2w1")
    return run_scenario("v2w1", tmp, {"FICACHE_DB": str(tmp / "registry.db")}, world=1), tmp


@pytest.fixture(scope="module")
def pr55671_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[dict[str, Any]], Path]:
    tmp = tmp_path_factory.mktemp("vllm-pr55671")
    node_root = tmp / "vllm-managed-root"
    env = {
        "FICACHE_DB": str(tmp / "registry.db"),
        "VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR": str(node_root),
    }
    return run_scenario("pr55671", tmp, env), tmp


def _assert_v2_cold_then_warm(results: list[dict[str, Any]], tmp: Path, asked: str) -> None:
    world = len(results)
    for rank, (first, second) in enumerate(
        zip(steps(results, "start1"), steps(results, "start2"), strict=True)
    ):
        assert first["exception"] is None and second["exception"] is None, first["exception"]
        # Under autotune_v2 vLLM's own tuning buckets apply (16 M buckets per weight
        # shape on 0.7.2.post1), so FlashInfer profiles at least the stand-in's N keys.
        tuned = first["profiled"]
        assert tuned >= N, first["dummy_runs"]
        r1 = first["report"]
        assert r1["status"] == "cold" and r1["reason"] is None, r1
        assert r1["tuned"] == tuned and r1["committed"] == tuned and r1["shared"] == tuned
        # vLLM's autotune_v2 call was sent to the start's own store, and what FlashInfer
        # published there was read back.
        assert r1["v2"]["redirected"] == [asked], r1["v2"]
        assert r1["v2"]["harvested"] == tuned
        assert second["profiled"] == 0 and second["hits"] == N
        r2 = second["report"]
        assert r2["status"] == "warm" and r2["loaded"] == tuned and r2["tuned"] == 0, r2
        assert r2["v2"]["served"] == tuned
        assert not ficache_warnings(first) and not ficache_warnings(second), rank
        if world > 1:
            assert first["identical_across_ranks"] and second["identical_across_ranks"]
    # Nothing was published to the root vLLM named, nor to FlashInfer's default root.
    for root in (tmp / "vllm-managed-root", tmp / "flashinfer-autotune"):
        assert not list(root.glob("v2/*/entries/*.json")), root
    with Registry.open(str(tmp / "registry.db"), create=False) as reg:
        commits = reg.log(limit=None)
    tuned = steps(results, "start1")[0]["profiled"]
    assert len(commits) == 1 and commits[0].added == tuned
    assert commits[0].provenance["v2_mode"]["harvested"] == tuned


def test_vllm_033_world1_v2_path_is_served_and_committed(
    v2w1_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, tmp = v2w1_run
    _assert_v2_cold_then_warm(results, tmp, "<flashinfer default>")


def test_pr55671_shaped_warmup_without_vllms_helpers_is_served(
    pr55671_run: tuple[list[dict[str, Any]], Path],
) -> None:
    results, tmp = pr55671_run
    assert all(r["pr55671_patched"] for r in results)
    _assert_v2_cold_then_warm(results, tmp, str(tmp / "vllm-managed-root"))
