"""A later warm start of one process keeps the slice its tuner provably still holds.

Real FlashInfer ``AutoTuner`` throughout; the multi-rank case runs on real gloo ranks
(``tests/kept_slice_ranks.py``). ``LoadProbe`` (instrumentation) counts
``load_configs`` calls; "holds exactly the slice" is compared with what a tuner cleared
and loaded by a start holds (``held``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from kept_slice_ranks import LoadProbe, held, one_rank_changed, start

from ficache._ranks import run_ranks

ALL = 18  # the stand-in's keys (3 shapes x 6 buckets)


def _reference(db: Path, autotuner: Any) -> dict[str, Any]:
    """What a start that clears and loads leaves the tuner holding (it loads: checked)."""
    autotuner.clear_cache()
    with LoadProbe(autotuner) as probe:
        out = start(db)
    assert probe.calls >= 1 and not out["report"]["load_kept"]
    return held(autotuner)


def test_a_second_start_with_an_unchanged_registry_loads_nothing(
    registry_path: Path, autotuner: Any
) -> None:
    db = registry_path
    start(db)  # cold: tunes, commits, loads the final slice
    expected = _reference(db, autotuner)
    assert len(expected["entries"]) == ALL and expected["profiled"] == 0
    for _ in range(2):
        with LoadProbe(autotuner) as probe:
            out = start(db)
        report = out["report"]
        assert probe.calls == 0 and report["load_kept"]
        assert (report["status"], report["loaded"], report["loaded_by_rank"]) == (
            "warm",
            ALL,
            [ALL],
        )
        assert report["tuned"] == 0 and out["profiled"] == 0 and report["reason"] is None
        assert held(autotuner) == expected


def _alter(autotuner: Any) -> None:
    key = sorted(autotuner._file_configs)[0]
    runner, _tactic = autotuner._file_configs[key]
    autotuner._file_configs[key] = (runner, 999)


def _add(autotuner: Any) -> None:
    key = sorted(autotuner._file_configs)[0]  # (op, runner, shapes, extras) as text
    runner, tactic = autotuner._file_configs[key]
    extra = key.replace("((", "((7777, 7777), (", 1)
    assert extra != key and extra not in autotuner._file_configs
    autotuner._file_configs[extra] = (runner, tactic)


def _remove(autotuner: Any) -> None:
    del autotuner._file_configs[sorted(autotuner._file_configs)[-1]]


def _record(autotuner: Any) -> None:
    autotuner.publish_namespaced_records("ficache_test", {"k": {"v": 1}})


def _protocol_record(autotuner: Any) -> None:
    if not hasattr(autotuner, "publish_protocol_record"):
        pytest.skip("this FlashInfer has no protocol records")
    autotuner.publish_protocol_record("ficache_test", "k", {"v": 1}, persist=False)


def _policy(autotuner: Any) -> None:
    key = sorted(autotuner._file_configs)[0]
    autotuner._file_config_policies[key] = ("cuda_graph_profile_replays", None, "l2", "hot")


@pytest.mark.parametrize(
    "change",
    [_alter, _add, _remove, _record, _protocol_record, _policy],
    ids=["entry altered", "entry added", "entry removed", "record", "protocol record", "policy"],
)
def test_a_tuner_changed_between_starts_is_cleared_and_reloaded(
    registry_path: Path, autotuner: Any, change: Callable[[Any], None]
) -> None:
    db = registry_path
    start(db)
    expected = _reference(db, autotuner)
    change(autotuner)  # private containers, changed by the test
    assert held(autotuner) != expected
    with LoadProbe(autotuner) as probe:
        out = start(db)
    report = out["report"]
    assert probe.calls >= 1 and not report["load_kept"]
    assert (report["status"], report["loaded"], report["tuned"]) == ("warm", ALL, 0)
    assert held(autotuner) == expected
    with LoadProbe(autotuner) as probe:  # and the reload is kept by the next start
        again = start(db)
    assert probe.calls == 0 and again["report"]["load_kept"] and held(autotuner) == expected


def test_a_registry_changed_between_starts_is_reloaded(registry_path: Path, autotuner: Any) -> None:
    db = registry_path
    start(db)
    _reference(db, autotuner)
    # Another server commits new keys (another process: this one's tuner is untouched).
    script = (
        "import sys, ficache\n"
        "from ficache.standin import standin_tune\n"
        "with ficache.warm_start(db=sys.argv[1]) as ws:\n"
        "    standin_tune(shapes=[(512, 512)])\n"
        "assert ws.report.committed == 6, ws.report\n"
    )
    subprocess.run([sys.executable, "-c", script, str(db)], check=True, timeout=300)
    with LoadProbe(autotuner) as probe:
        out = start(db)
    report = out["report"]
    assert probe.calls >= 1 and not report["load_kept"]
    assert (report["status"], report["loaded"]) == ("warm", ALL + 6)
    now = held(autotuner)
    assert now == _reference(db, autotuner) and len(now["entries"]) == ALL + 6


def test_a_protocol_record_another_server_committed_since_is_loaded_not_kept(
    registry_path: Path, autotuner: Any
) -> None:
    """The registry changed by a protocol record alone (no entry): the slice is not kept."""
    if not hasattr(autotuner, "publish_protocol_record"):
        pytest.skip("this FlashInfer has no protocol records")
    db = registry_path
    start(db)
    _reference(db, autotuner)
    with LoadProbe(autotuner) as probe:  # unchanged so far: kept
        assert start(db)["report"]["load_kept"] and probe.calls == 0
    # Another server (another process: this one's tuner is untouched) serves every entry
    # and publishes one protocol record, which its start commits.
    script = (
        "import sys, ficache\n"
        "from flashinfer.autotuner import AutoTuner\n"
        "from ficache.standin import standin_tune\n"
        "with ficache.warm_start(db=sys.argv[1]) as ws:\n"
        "    assert standin_tune().profiled == 0\n"
        "    AutoTuner.get().publish_protocol_record('other.v1', 'k', {'v': 7}, persist=False)\n"
        "assert (ws.report.committed, ws.report.protocol_committed) == (0, 1), ws.report\n"
    )
    subprocess.run([sys.executable, "-c", script, str(db)], check=True, timeout=300)
    with LoadProbe(autotuner) as probe:
        out = start(db)
    report = out["report"]
    assert probe.calls >= 1 and not report["load_kept"]
    assert (report["status"], report["loaded"], report["protocol_loaded"]) == ("warm", ALL, 1)
    now = held(autotuner)
    assert now["protocol"] == {"other.v1": {"k": {"v": 7}}}, now["protocol"]
    assert now == _reference(db, autotuner)


def test_ranks_that_keep_and_ranks_that_reload_agree(tmp_path: Path) -> None:
    rank0, rank1 = run_ranks(one_rank_changed, 2, str(tmp_path), timeout=600)
    for out in (rank0, rank1):
        assert out["first_calls"] >= 1 and not out["first"]["report"]["load_kept"]
        report = out["second"]["report"]
        assert (report["status"], report["reason"], report["loaded"]) == ("warm", None, ALL)
        assert report["loaded_by_rank"] == [ALL, ALL] and report["synchronized"]
        assert report["tuned_by_rank"] == [0, 0] and out["second"]["profiled"] == 0
        assert out["held_as_expected"] and out["loaded_keys"] == ALL
    assert rank0["second_calls"] == 0 and rank0["second"]["report"]["load_kept"]
    assert rank1["second_calls"] >= 1 and not rank1["second"]["report"]["load_kept"]


_ATTRIBUTES = (
    "import json; from flashinfer.autotuner import AutoTuner; "
    "print(json.dumps(sorted(vars(AutoTuner.get()))))"
)


def test_every_autotuner_attribute_of_each_flashinfer_ci_runs_is_classified() -> None:
    """A kept slice compares what ``ficache.tuner._HELD_STATE`` names; an ``AutoTuner``
    attribute the module has not classified makes every start clear and load. Each
    FlashInfer CI runs (this env's, and 0.7.2.post1 through its own python) has none, so
    a release that adds state fails here instead of silently never keeping a slice."""
    import json
    import os
    import types

    from flashinfer.autotuner import AutoTuner
    from flashinfer_072 import flashinfer_072_python

    from ficache.tuner import unclassified_state

    assert unclassified_state(AutoTuner.get()) == set()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    names = json.loads(
        subprocess.run(
            [flashinfer_072_python(), "-c", _ATTRIBUTES],
            check=True,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        ).stdout
    )
    assert "profiling_cache" in names
    assert unclassified_state(types.SimpleNamespace(**dict.fromkeys(names))) == set()


def test_a_tuner_with_state_this_code_has_not_classified_clears_and_loads(
    registry_path: Path, autotuner: Any
) -> None:
    """An attribute ``ficache.tuner`` does not know (as a newer FlashInfer could add) means
    the tuner may hold something a kept slice would not compare: the start loads."""
    autotuner.clear_cache()
    start(registry_path)  # cold: fills the registry (the stand-in tunes)
    autotuner.clear_cache()
    start(registry_path)  # loads and notes the slice
    autotuner._ficache_test_unknown_state = {}  # the stand-in for state of a newer release
    try:
        with LoadProbe(autotuner) as probe:
            out = start(registry_path)
        assert probe.calls >= 1 and not out["report"]["load_kept"]
        assert out["report"]["loaded"] == ALL
    finally:
        del autotuner._ficache_test_unknown_state
