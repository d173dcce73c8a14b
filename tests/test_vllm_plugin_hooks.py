"""The vLLM plugin's mechanics that need no vLLM: the switch, the import hook, the fallback,
and one worker's start (its log line and the provenance it commits).

Runs everywhere (``tests/test_vllm_plugin.py`` covers the real thing under
``tox -e vllm``). The module being patched is a stand-in module written to
``tmp_path`` and named as such: ``TARGET_MODULE`` is pointed at it. A worker's
start runs the plugin's wrapper body (``_run``) in this one process, with
stand-ins for what ``_plan`` reads from vLLM (its config and tuning group),
over a real SQLite registry and the real AutoTuner.
"""

from __future__ import annotations

import importlib
import json
import logging
import re
import sqlite3
import sys
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ficache.engine_env as engine_env
import ficache.vllm_plugin as plugin

STANDIN_KERNEL_WARMUP = """
calls = []


def flashinfer_autotune(runner, *, skip_attn=False):
    calls.append((runner, skip_attn))
    return "vllm's result"
"""


#: A stand-in for vLLM 0.33's kernel_warmup with what the wrapper uses: its per-rank file
#: resolver and v2 switch (both replaced during a start), and ``flashinfer_autotune``, which
#: tunes the CPU stand-in op as vLLM's dummy runs would tune FlashInfer's ops.
STANDIN_KERNEL_WARMUP_033 = """
from ficache.standin import standin_tune

calls = []


def resolve_rank_flashinfer_autotune_file(runner):
    return "vllm's own per-rank file"


def use_flashinfer_autotune_v2(runner):
    return True


def flashinfer_autotune(runner):
    calls.append(
        (str(resolve_rank_flashinfer_autotune_file(runner)), use_flashinfer_autotune_v2(runner))
    )
    standin_tune()
    return "vllm's result"
"""


def install_standin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, suffix: str = ""
) -> str:
    """Write a stand-in kernel_warmup module, importable, not imported; point the plugin at it."""
    name = f"ficache_standin_kernel_warmup{suffix}_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugin, "TARGET_MODULE", name)
    monkeypatch.setattr(plugin, "_finder", None)
    monkeypatch.setattr(plugin, "_warned", set())
    monkeypatch.setattr(plugin, "_last_report", None)
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv("FICACHE_VLLM", raising=False)
    return name


@pytest.fixture
def standin_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A stand-in for vLLM's kernel_warmup (only ``flashinfer_autotune``), importable, not imported."""
    name = install_standin(tmp_path, monkeypatch, STANDIN_KERNEL_WARMUP)
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("value", "expected", "warned"),
    [
        (None, True, False),
        ("", True, False),
        ("1", True, False),
        ("yes", True, False),
        ("Y", True, False),
        ("0", False, False),
        ("false", False, False),
        (" OFF ", False, False),
        ("n", False, False),
        ("N", False, False),
        ("nope", True, True),
        ("2", True, True),
    ],
)
def test_switch(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str | None,
    expected: bool,
    warned: bool,
) -> None:
    """Every on/off variable reads the same spellings; a value that is neither is one
    warning naming the variable and the plugin stays on (issue 35: ``n`` left it on
    without a word)."""
    monkeypatch.setattr(engine_env, "_warned", set())
    if value is None:
        monkeypatch.delenv("FICACHE_VLLM", raising=False)
    else:
        monkeypatch.setenv("FICACHE_VLLM", value)
    with caplog.at_level(logging.WARNING, logger="ficache.engine"):
        assert plugin.enabled() is expected
        assert plugin.enabled() is expected
    warnings = [r.getMessage() for r in caplog.records if "FICACHE_VLLM" in r.getMessage()]
    assert len(warnings) == (1 if warned else 0)


@pytest.mark.parametrize(
    ("value", "expected", "warned"),
    [
        (None, 60.0, False),
        ("", 60.0, False),
        ("5", 5.0, False),
        (" 0.5 ", 0.5, False),
        ("0", 60.0, True),
        ("-3", 60.0, True),
        ("inf", 60.0, True),
        ("nan", 60.0, True),
        ("ten", 60.0, True),
    ],
)
def test_registry_timeout(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str | None,
    expected: float,
    warned: bool,
) -> None:
    monkeypatch.setattr(plugin, "_warned", set())
    if value is None:
        monkeypatch.delenv("FICACHE_REGISTRY_TIMEOUT", raising=False)
    else:
        monkeypatch.setenv("FICACHE_REGISTRY_TIMEOUT", value)
    with caplog.at_level(logging.WARNING, logger="ficache.vllm"):
        assert plugin.registry_timeout() == expected
        assert plugin.registry_timeout() == expected
    expected_lines = (
        [
            f"ficache: FICACHE_REGISTRY_TIMEOUT={value.strip()!r} is not a positive number of "
            "seconds; using 60"
        ]
        if warned and value is not None
        else []
    )
    assert [r.getMessage() for r in caplog.records] == expected_lines  # once, not per call


def test_import_hook_patches_the_module_when_it_is_imported(standin_target: str) -> None:
    plugin.register()
    plugin.register()  # idempotent: one finder
    assert sum(isinstance(f, plugin._PatchOnImport) for f in sys.meta_path) == 1
    assert standin_target not in sys.modules
    module = importlib.import_module(standin_target)
    wrapper = module.flashinfer_autotune
    original = wrapper.__ficache_original__
    assert original.__module__ == standin_target and original.__name__ == "flashinfer_autotune"
    assert module.__file__ is not None and module.__file__.endswith(f"{standin_target}.py")


def test_module_imported_before_register_is_patched_in_place_once(standin_target: str) -> None:
    module = importlib.import_module(standin_target)
    original = module.flashinfer_autotune
    plugin.register()
    plugin.register()
    assert module.flashinfer_autotune.__ficache_original__ is original  # not wrapped twice
    assert not any(isinstance(f, plugin._PatchOnImport) for f in sys.meta_path)


def test_switched_off_register_installs_nothing(
    standin_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FICACHE_VLLM", "0")
    before = list(sys.meta_path)
    plugin.register()
    assert sys.meta_path == before
    module = importlib.import_module(standin_target)
    assert not hasattr(module.flashinfer_autotune, "__ficache_original__")


def test_register_never_raises(
    standin_target: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(list[Any]):
        def insert(self, index: Any, item: Any) -> None:
            raise RuntimeError("meta_path is read-only here")

    monkeypatch.setattr(sys, "meta_path", Broken(sys.meta_path))
    with caplog.at_level(logging.WARNING, logger="ficache.vllm"):
        plugin.register()
    assert [r.getMessage() for r in caplog.records] == [
        "ficache: vLLM plugin not installed (RuntimeError: meta_path is read-only here)"
    ]


@pytest.mark.parametrize("managed_store", [False, True])
def test_unsupported_shape_runs_the_original_unchanged_with_one_warning(
    standin_target: str,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
    managed_store: bool,
) -> None:
    # The stand-in lacks vLLM's file-cache helpers. Without FlashInfer's managed store
    # the plugin has no way to serve it; with one it would serve it through the store,
    # and steps aside only because this machine has no vLLM (its process groups).
    from ficache import v2_mode

    monkeypatch.setattr(v2_mode, "available", lambda: managed_store)
    module = importlib.import_module(standin_target)
    plugin.register()
    runner = object()
    with caplog.at_level(logging.WARNING, logger="ficache.vllm"):
        assert module.flashinfer_autotune(runner, skip_attn=True) == "vllm's result"
        assert module.flashinfer_autotune(runner) == "vllm's result"
    assert module.calls == [(runner, True), (runner, False)]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    if managed_store:
        assert "cannot import vllm.distributed.parallel_state" in messages[0]
    else:
        assert (
            "lacks resolve_rank_flashinfer_autotune_file, use_flashinfer_autotune_v2 and this "
            "FlashInfer has no managed store" in messages[0]
        )
    assert plugin.last_report() is None


def test_switched_off_at_call_time_calls_the_original(
    standin_target: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = importlib.import_module(standin_target)
    plugin.register()
    monkeypatch.setenv("FICACHE_VLLM", "0")
    with caplog.at_level(logging.DEBUG, logger="ficache"):
        assert module.flashinfer_autotune("runner") == "vllm's result"
    assert module.calls == [("runner", False)]
    assert caplog.records == []


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        ({}, "tp1-pp1-dp1-ep1"),
        ({"tensor_parallel_size": 2}, "tp2-pp1-dp1-ep1"),
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, "tp4-pp2-dp1-ep1"),
        (
            {"tensor_parallel_size": 2, "data_parallel_size": 4, "enable_expert_parallel": True},
            "tp2-pp1-dp4-ep8",
        ),
    ],
)
def test_layout_of_a_parallel_config(config: dict[str, Any], layout: str) -> None:
    assert plugin.layout_of(SimpleNamespace(**config)) == layout


# -- one worker's start -------------------------------------------------------------------

#: The per-worker line as the README documents it (its example lines must match it too).
LOG_LINE = re.compile(
    r"ficache: (cold|warm|partial|uncached|replay) start on rank \d+/\d+ "
    r"\(tp\d+-pp\d+-dp\d+-ep\d+\): loaded \d+, tuned \d+, committed \d+( \(commit \d+\))?"
    r"(, missed \d+)? in \d+\.\d\d s(; .+)?"
)
README = Path(__file__).resolve().parent.parent / "README.md"
MODEL = "Qwen/Qwen3-30B-A3B-FP8"


class StandInVllmConfig:
    """STAND-IN for vLLM's ``VllmConfig``: the parts the plugin reads (a tp1 server of MODEL)."""

    parallel_config = SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1)
    model_config = SimpleNamespace(model=MODEL)

    def compute_hash(self) -> str:
        return "standin-config-hash"


#: STAND-IN for vLLM's tuning ``GroupCoordinator`` of a one-process server: no process
#: group, so the warm start runs as world 1 (as ``warm_start(None)`` does undistributed).
ONE_PROCESS_GROUP = SimpleNamespace(cpu_group=None, rank_in_group=0, world_size=1)


@pytest.fixture
def standin_target_033(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = install_standin(tmp_path, monkeypatch, STANDIN_KERNEL_WARMUP_033, "_033")
    yield name
    sys.modules.pop(name, None)


def readme_log_lines() -> list[str]:
    text = README.read_text()
    block = text.split("At startup every worker logs one line from logger `ficache.vllm`:", 1)[1]
    return block.split("```", 2)[1].strip().splitlines()


def test_the_readme_log_lines_follow_the_documented_format() -> None:
    lines = readme_log_lines()

    assert [line.split(" start")[0] for line in lines] == [
        "ficache: cold",
        "ficache: warm",
        "ficache: uncached",
        "ficache: replay",
    ]
    for line in lines:
        assert LOG_LINE.fullmatch(line), line


def test_a_worker_start_logs_the_readme_line_and_commits_the_model_in_its_provenance(
    standin_target_033: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    autotuner: Any,
) -> None:
    module = importlib.import_module(standin_target_033)
    registry = tmp_path / "registry.db"
    monkeypatch.setenv("FICACHE_DB", str(registry))
    monkeypatch.setenv("FICACHE_ADOPT", "0")  # no vLLM caches here to adopt
    config = StandInVllmConfig()
    plan = plugin._Plan(
        ONE_PROCESS_GROUP,
        plugin.layout_of(config.parallel_config),
        plugin.provenance_of(config),
    )
    original = module.flashinfer_autotune
    runner = object()

    def worker_start() -> Any:
        autotuner.clear_cache()  # a restarted server holds nothing yet
        result = plugin._run(plan, original, module, runner, (), {})
        assert result == "vllm's result"
        return plugin.last_report()

    with caplog.at_level(logging.INFO, logger="ficache.vllm"):
        cold = worker_start()
        warm = worker_start()
        garbage = tmp_path / "garbage.db"
        garbage.write_bytes(b"not a registry\n" * 64)
        monkeypatch.setenv("FICACHE_DB", str(garbage))
        uncached = worker_start()
    lines = [r.getMessage() for r in caplog.records if r.name == "ficache.vllm"]

    where = "rank 0/1 (tp1-pp1-dp1-ep1)"
    assert lines == [
        f"ficache: cold start on {where}: loaded 0, tuned 18, committed 18 (commit 1) "
        f"in {cold.total_seconds:.2f} s",
        f"ficache: warm start on {where}: loaded 18, tuned 0, committed 0 "
        f"in {warm.total_seconds:.2f} s",
        f"ficache: uncached start on {where}: loaded 0, tuned 18, committed 0 "
        f"in {uncached.total_seconds:.2f} s; {garbage} is not a SQLite database; pass another "
        "--db or move the file away",
    ]
    assert all(LOG_LINE.fullmatch(line) for line in lines)
    assert [r.levelname for r in caplog.records if r.name == "ficache.vllm"] == ["INFO"] * 3
    # During each call vLLM's own file cache pointed into a scratch directory and v2 was off;
    # afterwards both are vLLM's again.
    assert [
        (Path(file).parent.name.startswith("ficache-vllm-rank0-"), v2) for file, v2 in module.calls
    ] == [(True, False)] * 3
    assert module.resolve_rank_flashinfer_autotune_file(runner) == "vllm's own per-rank file"
    assert module.use_flashinfer_autotune_v2(runner) is True

    with closing(sqlite3.connect(registry)) as conn:
        rows = conn.execute("SELECT kind, added, provenance FROM commits ORDER BY id").fetchall()
    [(kind, added, provenance_json)] = rows  # the warm and uncached starts committed nothing
    provenance = json.loads(provenance_json)
    assert (kind, added) == ("startup", 18)
    assert {k: provenance[k] for k in ("framework", "model", "vllm_config_hash", "layout")} == {
        "framework": "vllm",
        "model": MODEL,
        "vllm_config_hash": "standin-config-hash",
        "layout": "tp1-pp1-dp1-ep1",
    }


# -- FICACHE_MODE=replay ------------------------------------------------------------------

#: A stand-in for vLLM 0.33's kernel_warmup whose ``flashinfer_autotune`` asks FlashInfer's
#: REAL ``choose_one`` for every key of the CPU stand-in op under ``autotune(True)``, as
#: vLLM's dummy runs ask for FlashInfer's ops (only CUDA timing stood in:
#: ``ficache.standin_timing``).
STANDIN_KERNEL_WARMUP_SERVE = """
from ficache.standin_timing import real_loop_serve

calls = []


def resolve_rank_flashinfer_autotune_file(runner):
    return "vllm's own per-rank file"


def use_flashinfer_autotune_v2(runner):
    return True


def flashinfer_autotune(runner):
    calls.append(real_loop_serve())
    return "vllm's result"
"""


@pytest.mark.parametrize(
    ("value", "expected", "warned"),
    [
        (None, "tune", False),
        ("", "tune", False),
        ("tune", "tune", False),
        ("replay", "replay", False),
        (" Replay ", "replay", False),
        ("replays", "tune", True),
        ("off", "tune", True),
    ],
)
def test_ficache_mode(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    value: str | None,
    expected: str,
    warned: bool,
) -> None:
    from ficache import engine_env

    monkeypatch.setattr(engine_env, "_warned", set())
    if value is None:
        monkeypatch.delenv("FICACHE_MODE", raising=False)
    else:
        monkeypatch.setenv("FICACHE_MODE", value)
    with caplog.at_level(logging.WARNING, logger="ficache.engine"):
        assert engine_env.start_mode() == expected
        assert engine_env.start_mode() == expected
    assert [r.getMessage() for r in caplog.records] == (
        [f"ficache: FICACHE_MODE={value!r} is not one of tune, replay; starting in tune mode"]
        if warned
        else []
    )


def test_a_replay_worker_start_serves_profiles_nothing_and_counts_its_misses(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    autotuner: Any,
    dump_db: Any,
) -> None:
    from ficache import engine_env
    from ficache.registry import Registry

    name = install_standin(tmp_path, monkeypatch, STANDIN_KERNEL_WARMUP_SERVE, "_serve")
    monkeypatch.setattr(engine_env, "_warned", set())
    module = importlib.import_module(name)
    registry = tmp_path / "registry.db"
    monkeypatch.setenv("FICACHE_DB", str(registry))
    monkeypatch.setenv("FICACHE_ADOPT", "0")
    monkeypatch.delenv("FICACHE_MODE", raising=False)
    config = StandInVllmConfig()
    plan = plugin._Plan(
        ONE_PROCESS_GROUP, plugin.layout_of(config.parallel_config), plugin.provenance_of(config)
    )
    original = module.flashinfer_autotune

    def worker_start() -> Any:
        autotuner.clear_cache()  # a restarted server holds nothing yet
        assert plugin._run(plan, original, module, object(), (), {}) == "vllm's result"
        return plugin.last_report(), module.calls[-1]

    try:
        cold, _ = worker_start()  # tune mode: vLLM's dummy runs tune all 18 keys
        assert (cold.mode, cold.committed) == ("tune", 18)
        with closing(sqlite3.connect(registry)) as conn, conn:
            conn.execute("DELETE FROM entries WHERE id % 2 = 0")  # half the keys lost
            kept = dict(conn.execute("SELECT key, tactic FROM entries"))
        before = dump_db(str(registry))
        monkeypatch.setenv("FICACHE_MODE", "replay")

        with caplog.at_level(logging.INFO, logger="ficache"):
            replay, served = worker_start()
        lines = [r.getMessage() for r in caplog.records if r.name == "ficache.vllm"]
        after_replay = dump_db(str(registry))

        monkeypatch.setenv("FICACHE_MODE", "replay-please")
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="ficache"):
            typo, typo_served = worker_start()
            worker_start()  # the warning comes once per process
        warnings = [r.getMessage() for r in caplog.records]
    finally:
        sys.modules.pop(name, None)

    where = "rank 0/1 (tp1-pp1-dp1-ep1)"
    assert lines == [
        f"ficache: replay start on {where}: loaded 9, tuned 0, committed 0, missed 9 "
        f"in {replay.total_seconds:.2f} s",
    ]
    assert LOG_LINE.fullmatch(lines[0])
    assert (replay.mode, replay.status, replay.missed, replay.tuned) == ("replay", "warm", 9, 0)
    assert (served.profiled, served.reduces, served.fallbacks) == (0, 0, 9)
    # Each kept key got the registry's tactic; each lost key FlashInfer's fallback.
    assert {k: t for k, t in served.tactics.items() if t != -1} == {
        k: json.loads(t) for k, t in kept.items()
    }
    assert len(served.tactics) == 18
    # Nothing committed: the only change is the fingerprint's served mark and counts.
    assert [t for t in after_replay if "fingerprints" not in t] == [
        t for t in before if "fingerprints" not in t
    ]
    assert after_replay != before
    with Registry.open(str(registry)) as reg:
        assert len(reg.log()) == 2  # the cold start's commit, then the typo's (tune) one
        [(_fid, starts, replays, misses)] = reg.stats().start_counts
    assert (starts, replays, misses) == (3, 1, 9)  # the replay and the two typo starts
    # A mode it does not know: one warning, and a normal (tune) start that tunes the 9.
    assert warnings == [
        "ficache: FICACHE_MODE='replay-please' is not one of tune, replay; starting in tune mode"
    ]
    assert (typo.mode, typo.status, typo.tuned, typo.committed) == ("tune", "partial", 9, 9)
    assert typo_served.profiled == 9


def test_a_replay_start_adopts_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, autotuner: Any
) -> None:
    name = install_standin(tmp_path, monkeypatch, STANDIN_KERNEL_WARMUP_SERVE, "_adopt")
    module = importlib.import_module(name)
    monkeypatch.setenv("FICACHE_DB", str(tmp_path / "registry.db"))
    monkeypatch.delenv("FICACHE_ADOPT", raising=False)  # adoption on, as by default
    adopted: list[str] = []
    monkeypatch.setattr(plugin, "_adopt_vllm_caches", lambda plan, runner: adopted.append("x"))
    config = StandInVllmConfig()
    plan = plugin._Plan(
        ONE_PROCESS_GROUP, plugin.layout_of(config.parallel_config), plugin.provenance_of(config)
    )
    try:
        monkeypatch.setenv("FICACHE_MODE", "replay")
        plugin._run(plan, module.flashinfer_autotune, module, object(), (), {})
        replay = plugin.last_report()
        monkeypatch.setenv("FICACHE_MODE", "tune")
        plugin._run(plan, module.flashinfer_autotune, module, object(), (), {})
    finally:
        sys.modules.pop(name, None)

    assert replay is not None
    assert (replay.mode, replay.missed, replay.committed) == ("replay", 18, 0)
    assert adopted == ["x"]  # only the tune start adopted: a replay start commits nothing
