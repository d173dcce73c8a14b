"""Ranks of ``tests/test_kept_slice.py``: repeated warm starts in one process per rank, on a
real gloo group and the real ``AutoTuner``, where one rank's tuner changed between starts.

``LoadProbe`` is instrumentation named as such: it counts ``AutoTuner.load_configs`` calls
(the real method, wrapped on the instance for the block and restored after).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from ficache.standin import standin_tune
from ficache.sync import warm_start
from ficache.tuner import FlashInferTuner


class LoadProbe:
    """Counts ``load_configs`` calls on ``autotuner`` inside ``with`` (the real method runs)."""

    def __init__(self, autotuner: Any) -> None:
        self.autotuner = autotuner
        self.calls = 0

    def __enter__(self) -> LoadProbe:
        original = self.autotuner.load_configs

        def counted(path: str) -> bool:
            self.calls += 1
            return bool(original(path))

        self.autotuner.load_configs = counted
        return self

    def __exit__(self, *exc: object) -> None:
        del self.autotuner.load_configs


def held(autotuner: Any) -> dict[str, Any]:
    """What the tuner holds: the entries it would save, its records, its profiling cache."""
    tuner = FlashInferTuner(autotuner)
    return {
        "entries": tuner.entries(),
        "records": tuner.records(),
        "protocol": tuner.protocol_records(),
        "profiled": len(autotuner.profiling_cache),
    }


def start(db: Path, **kwargs: Any) -> dict[str, Any]:
    """One warm start around the stand-in's tuning loop; the report and what was profiled."""
    with warm_start(None, db=str(db), timeout=60.0, **kwargs) as ws:
        result = standin_tune()
    return {"report": ws.report.as_json(), "profiled": result.profiled}


def one_rank_changed(rank: int, world: int, root: str) -> dict[str, Any]:
    """Cold start, then a start that loads; then rank 1 alone alters one entry its tuner
    holds, and a third start keeps the slice on rank 0 and reloads it on rank 1."""
    from flashinfer.autotuner import AutoTuner

    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    db = Path(root) / "registry.db"
    autotuner = AutoTuner.get()
    autotuner.clear_cache()
    start(db)  # cold: tunes, commits, loads the final slice
    autotuner.clear_cache()
    with LoadProbe(autotuner) as first_probe:
        first = start(db)
    expected = held(autotuner)
    if rank == 1:
        key = sorted(autotuner._file_configs)[0]  # private: the change this test makes
        runner, _tactic = autotuner._file_configs[key]
        autotuner._file_configs[key] = (runner, 999)
    with LoadProbe(autotuner) as probe:
        second = start(db)
    return {
        "first": first,
        "first_calls": first_probe.calls,
        "second": second,
        "second_calls": probe.calls,
        "held_as_expected": held(autotuner) == expected,
        "loaded_keys": len(expected["entries"]),
    }
