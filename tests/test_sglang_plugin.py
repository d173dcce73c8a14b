"""The SGLang plugin against real SGLang 0.5.23 (``tox -e sglang``).

Two processes per scenario (``tests/sglang_ranks.py``, under a hard timeout)
run SGLang's plugin loader, its gloo process groups and its real
``flashinfer_autotune_context``, with FlashInfer's real tuning loop inside
and only CUDA timing replaced. All scenarios start at once (they import
SGLang, which takes most of the time, in parallel).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang") is None,
        reason="needs SGLang 0.5.23 installed: run `tox -e sglang`",
    ),
]

RANKS_SCRIPT = Path(__file__).with_name("sglang_ranks.py")
WORLD = 2
#: Hard kill timeout for every scenario's processes (importing SGLang takes most of it).
TIMEOUT = 420.0
#: Keys of the stand-in op: 6 buckets per weight shape.
KEYS_A, KEYS_AB = 12, 18


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _start(scenario: str, tmp: Path, env: dict[str, str | None]) -> tuple[list[Any], list[Any]]:
    full_env = dict(os.environ)
    full_env.update(
        {
            "SGLANG_CACHE_DIR": str(tmp / "sglang-cache"),
            "XDG_CACHE_HOME": str(tmp / "user-cache"),
            "FLASHINFER_AUTOTUNE_CACHE_DIR": str(tmp / "flashinfer-autotune"),
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
        }
    )
    for name in ("FICACHE_DB", "FICACHE_SGLANG", "FICACHE_ADOPT", "SGLANG_PLUGINS"):
        full_env.pop(name, None)
    for key, value in env.items():
        if value is None:
            full_env.pop(key, None)
        else:
            full_env[key] = value
    port = free_port()
    logs = [open(tmp / f"rank{r}.log", "w") for r in range(WORLD)]  # noqa: SIM115
    procs = [
        subprocess.Popen(
            [sys.executable, str(RANKS_SCRIPT), scenario, str(r), str(WORLD), str(port), str(tmp)],
            env=full_env,
            stdout=logs[r],
            stderr=subprocess.STDOUT,
        )
        for r in range(WORLD)
    ]
    return procs, logs


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[list[dict[str, Any]], Path]]:
    """Every scenario, started together, each rank killed after ``TIMEOUT`` seconds."""
    scenarios = {
        "plugin": {},
        "off": {"FICACHE_SGLANG": "0"},
        "bare": {"SGLANG_PLUGINS": "no-such-plugin"},
    }
    started: dict[str, tuple[Path, list[Any], list[Any]]] = {}
    deadline = time.monotonic() + TIMEOUT
    try:
        for name, env in scenarios.items():
            tmp = tmp_path_factory.mktemp(f"sglang-{name}")
            started[name] = (tmp, *_start(name if name == "plugin" else "twice", tmp, env))
        for _tmp, procs, _logs in started.values():
            for proc in procs:
                try:
                    proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
                except subprocess.TimeoutExpired:
                    break
        stuck = [
            (name, r)
            for name, (_t, procs, _l) in started.items()
            for r, p in enumerate(procs)
            if p.poll() is None
        ]
    finally:
        for _tmp, procs, logs in started.values():
            for proc in procs:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(10)
            for log in logs:
                log.close()

    def tail(tmp: Path, rank: int) -> str:
        return (tmp / f"rank{rank}.log").read_text()[-4000:]

    if stuck:
        pytest.fail(
            f"still running after {TIMEOUT:g} s, killed: {stuck}\n"
            + "\n".join(f"--- {n} rank {r} ---\n{tail(started[n][0], r)}" for n, r in stuck)
        )
    out: dict[str, tuple[list[dict[str, Any]], Path]] = {}
    for name, (tmp, procs, _logs) in started.items():
        results = []
        for rank, proc in enumerate(procs):
            path = tmp / f"rank{rank}.json"
            if not path.exists():
                pytest.fail(f"{name}: rank {rank} wrote no result\n{tail(tmp, rank)}")
            result = json.loads(path.read_text())
            # The plugin scenario's last step ends each rank with exit code 3 (a failed pass).
            expected = (0, 3) if name == "plugin" else (0,)
            if result.get("error") or proc.returncode not in expected:
                pytest.fail(
                    f"{name}: rank {rank} failed:\n{result.get('error')}\n{tail(tmp, rank)}"
                )
            results.append(result)
        out[name] = (results, tmp)
    return out


def steps(results: list[dict[str, Any]], name: str) -> list[dict[str, Any]]:
    return [r["steps"][name] for r in results]


def warnings_of(step: dict[str, Any]) -> list[str]:
    return [r["message"] for r in step["records"] if r["level"] == "WARNING"]


def test_load_plugins_discovers_the_plugin_and_hooks_the_real_context(runs: Any) -> None:
    results, _tmp = runs["plugin"]
    for result in results:
        assert result["hook"]["wrapped"] is True
        assert (
            result["hook"]["module_of_fn"] == "sglang.srt.model_executor.runner.flashinfer_autotune"
        )


def test_cold_pass_tunes_on_both_ranks_and_commits(runs: Any) -> None:
    results, tmp = runs["plugin"]
    for step in steps(results, "start_cold"):
        assert step["exception"] is None, step["exception"]
        assert step["profiled"] == KEYS_A
        assert step["report"]["status"] == "cold"
        assert step["report"]["committed"] == KEYS_A
        assert step["identical_across_ranks"] is True
        assert step["report"]["layout"] == "tp2-pp1-dp1-ep1.pp0.dp0"
    from ficache.registry import Registry

    with Registry.open(str(tmp / "registry.db"), create=False) as reg:
        commits = reg.log()
        assert any(c.kind == "startup" for c in commits)


def _stored(db: Path) -> tuple[int, list[tuple[int, int, int]]]:
    """A registry file's entry count, and its fingerprints' (served, replay starts, misses)."""
    import sqlite3

    con = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        entries = con.execute("SELECT count(*) FROM entries").fetchone()[0]
        counts = con.execute(
            "SELECT served_starts, replay_starts, replay_misses FROM fingerprints "
            "WHERE served_starts > 0 ORDER BY id"
        ).fetchall()
    finally:
        con.close()
    return int(entries), [tuple(int(v) for v in row) for row in counts]  # type: ignore[misc]


def test_extend_pass_in_the_same_process_is_served_from_the_first_read(runs: Any) -> None:
    # FICACHE_DB names a file in a directory that does not exist for this pass: a
    # second read could only fail (uncached) or create it. The pass reads nothing:
    # A is served from what the process read in the first pass, and B is committed
    # to the registry that read came from.
    results, tmp = runs["plugin"]
    for rank, step in enumerate(steps(results, "extend_same_read")):
        assert step["exception"] is None, step["exception"]
        assert step["hits"] == KEYS_A
        assert step["profiled"] == KEYS_AB - KEYS_A
        assert step["report"]["status"] == "partial"
        assert step["report"]["slice_cache"] == "reused"
        assert step["report"]["tuned"] == KEYS_AB - KEYS_A
        assert step["report"]["committed"] == KEYS_AB - KEYS_A
        assert step["entries"] == KEYS_AB
        assert step["identical_across_ranks"] is True
        assert not (tmp / f"absent-rank{rank}").exists()
    for step in steps(results, "start_cold"):
        assert step["report"]["slice_cache"] != "reused"
    # The cold pass and the extend pass both committed there.
    assert _stored(tmp / "registry.db")[0] == KEYS_AB


def test_replay_passes_profile_nothing_report_the_missing_keys_and_repeat_every_boot(
    runs: Any,
) -> None:
    results, tmp = runs["plugin"]
    boot1 = steps(results, "replay_boot1")
    for name in ("replay_boot1", "replay_extend", "replay_boot2"):
        for rank, step in enumerate(steps(results, name)):
            assert step["exception"] is None, step["exception"]
            assert step["profiled"] == 0, (name, rank)
            assert step["hits"] == KEYS_A
            report = step["report"]
            assert report["mode"] == "replay"
            assert report["missed"] == KEYS_AB - KEYS_A, (name, rank, report)
            assert report["tuned"] == 0 and report["committed"] == 0
            assert (report["slice_cache"] == "reused") == (name == "replay_extend"), report
            assert step["identical_across_ranks"] is True
            # Every boot and every rank: the same tactics for every key, misses included.
            assert step["state"] == boot1[0]["state"], (name, rank)
            infos = [r["message"] for r in step["records"] if r["level"] == "INFO"]
            assert any("missed 6" in line for line in infos), infos
    # Nothing committed; three replay starts served, with their misses counted.
    entries, counts = _stored(tmp / "replay.db")
    assert entries == KEYS_A
    assert counts == [(3, 3, 3 * (KEYS_AB - KEYS_A))]


def test_restart_is_warm_and_profiles_nothing(runs: Any) -> None:
    results, _tmp = runs["plugin"]
    for step in steps(results, "start_warm"):
        assert step["exception"] is None, step["exception"]
        assert step["profiled"] == 0
        assert step["hits"] == KEYS_A
        assert step["report"]["status"] == "warm"
        assert step["report"]["loaded"] == KEYS_AB  # the extend pass committed B there


def test_partial_registry_retunes_exactly_what_is_missing(runs: Any) -> None:
    results, _tmp = runs["plugin"]
    for step in steps(results, "start_partial"):
        assert step["exception"] is None, step["exception"]
        assert step["report"]["loaded"] == KEYS_A
        assert step["profiled"] == KEYS_AB - KEYS_A
        assert step["report"]["committed"] == KEYS_AB - KEYS_A
        assert step["identical_across_ranks"] is True


def test_sglang_own_files_are_neither_read_nor_written_under_ficache(runs: Any) -> None:
    results, _tmp = runs["plugin"]
    for name in (
        "start_cold",
        "extend_same_read",
        "start_warm",
        "start_partial",
        "replay_boot1",
        "replay_extend",
    ):
        for step in steps(results, name):
            assert step["sglang_files"] == {}, name
    for rank, step in enumerate(steps(results, "sglang_writes")):
        names = [Path(p).name for p in step["sglang_files"]]
        assert f"rank_tp{rank}_pp0_dp0.json" in names


def test_empty_registry_adopts_sglang_own_files_and_profiles_nothing(runs: Any) -> None:
    results, tmp = runs["plugin"]
    for step in steps(results, "adopt"):
        assert step["exception"] is None, step["exception"]
        assert step["profiled"] == 0
        assert step["report"]["loaded"] == KEYS_AB
    infos = [
        r["message"]
        for r in steps(results, "adopt")[0]["records"]
        if "adopted SGLang" in r["message"]
    ]
    assert len(infos) == 1, steps(results, "adopt")[0]["records"]
    assert f"{KEYS_AB} entries ({KEYS_AB} shared, 0 scoped)" in infos[0]


def test_a_rank_raising_inside_the_context_frees_its_peer_and_commits_nothing(runs: Any) -> None:
    results, tmp = runs["plugin"]
    failing, peer = steps(results, "rank1_fails")[1], steps(results, "rank1_fails")[0]
    assert "injected failure" in failing["exception"]
    assert peer["exception"] is not None
    # Freed by the closed connection (gloo says so), not by the group's 60 s timeout.
    first_line = peer["exception"].splitlines()[0].lower()
    assert "closed" in first_line or "reset" in first_line, first_line
    assert "timed out" not in first_line and "timeout" not in first_line, first_line
    assert failing["report"] is None and peer["report"] is None
    from ficache.registry import Registry

    db = tmp / "fails.db"
    if db.exists():
        with Registry.open(str(db), create=False) as reg:
            assert reg.log() == [] or all(c.kind != "startup" for c in reg.log())


def test_ficache_sglang_0_leaves_sglang_byte_for_byte(runs: Any) -> None:
    off, _t1 = runs["off"]
    bare, _t2 = runs["bare"]
    for result in off + bare:
        assert result["hook"]["is_sglangs_own"] is True, result["hook"]
    for name in ("first", "second", "restarted"):
        for a, b in zip(steps(off, name), steps(bare, name), strict=True):
            assert a["exception"] is None and b["exception"] is None
            assert a["report"] is None
            assert a["sglang_files"] == b["sglang_files"]
            assert a["state"] == b["state"]
            assert (a["profiled"], a["hits"]) == (b["profiled"], b["hits"])
    # SGLang's own cache at work: the restart loaded its per-rank file.
    for step in steps(off, "restarted"):
        assert step["profiled"] == 0
