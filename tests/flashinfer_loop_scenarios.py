"""The gloo fault scenarios again, tuning through FlashInfer's REAL ``choose_one`` loop.

``tests/test_flashinfer_loop.py`` runs ``run_plan`` on real gloo ranks
(``ficache._ranks.run_ranks``, a hard timeout). Each named scenario is either
one of ``tests/gloo_scenarios.py`` (run with ``loop="flashinfer"``: the block
calls ``ficache.standin_timing.real_loop_tune`` instead of the stand-in's own
loop) or one below, which only FlashInfer's loop can express:

- ``tactic_fails``: on rank 1 tactic 0 raises while it is timed. FlashInfer's
  ``_profile_single_kernel`` still all-reduces (``inf``) and re-raises;
  ``choose_one`` skips the tactic, so no rank picks it and the ranks stay in
  lockstep.
- ``oom_one_rank``: rank 1 runs out of memory preparing the runner for one
  weight shape. FlashInfer all-reduces the out-of-memory flag across the
  tuning group and every rank falls back (``runners[0], -1``) for that op:
  the other 12 keys are tuned and committed, the 6 of that shape on no rank.
- ``oom_then_warm``: ``oom_one_rank``'s registry started again without the
  fault: every rank loads the 12 and tunes exactly the missing 6.
- ``replay``: a cold start tunes the 18 keys; half of them are deleted behind
  the registry's back; then two replay boots (``warm_start(mode="replay")``)
  ask FlashInfer's ``choose_one`` for every key under ``autotune(True)``, as
  an engine's warmup does (``real_loop_serve``); a third, on rank 0 only in
  tune mode and rank 1 in replay mode, shows that rank 0's mode wins. Each
  records the tactics every key got, what FlashInfer profiled and the
  registry's rows.
"""

from __future__ import annotations

import dataclasses
import os
import sqlite3
import time
import traceback
from pathlib import Path
from typing import Any

import gloo_scenarios
import torch.distributed as dist
from gloo_scenarios import GROUP_TIMEOUT, registry_summary, start

from ficache.sync import warm_start


def tactic_fails(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    tune = {"fail_tactic": 0 if rank == 1 else None}
    return {"first": start(db, tune=tune), "registry": registry_summary(db)}


def oom_one_rank(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out = {"first": start(db, tune={"oom_shape": 1 if rank == 1 else None})}
    out["registry"] = registry_summary(db)
    dist.barrier()
    out["second"] = start(db)
    out["registry_after"] = registry_summary(db)
    return out


def _serve(db: Path, **kwargs: Any) -> dict[str, Any]:
    """One start whose block asks FlashInfer for every key (``real_loop_serve``)."""
    from ficache.standin_timing import real_loop_serve

    with warm_start(None, db=str(db), timeout=GROUP_TIMEOUT, **kwargs) as ws:
        served = real_loop_serve()
    return {"report": ws.report.as_json(), "serve": dataclasses.asdict(served)}


def _rows(db: Path) -> dict[str, Any]:
    """Every stored entry's tactic, the commits and the start counts, read with plain SQL
    once the served marks of this process's starts are written."""
    gloo_scenarios.settled()
    conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
    try:
        return {
            "entries": dict(conn.execute("SELECT key, tactic FROM entries")),
            "commits": conn.execute("SELECT count(*) FROM commits").fetchone()[0],
            "counts": conn.execute(
                "SELECT served_starts, replay_starts, replay_misses FROM fingerprints"
            ).fetchall(),
        }
    finally:
        conn.close()


def replay(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out: dict[str, Any] = {"cold": start(db)}
    if rank == 0:
        with sqlite3.connect(db) as conn:
            conn.execute("DELETE FROM entries WHERE id % 2 = 0")  # half the keys lost
        conn.close()
    dist.barrier()
    out["before"] = _rows(db)
    out["boot1"] = _serve(db, mode="replay")
    out["boot2"] = _serve(db, mode="replay")
    out["after"] = _rows(db)
    dist.barrier()
    out["mixed"] = _serve(db, mode="tune" if rank == 0 else "replay")  # rank 0's mode wins
    out["after_mixed"] = _rows(db)
    return out


OWN = {f.__name__: f for f in (tactic_fails, oom_one_rank, replay)}


def run_plan(rank: int, world: int, root: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Run the named scenarios in order on this rank, through FlashInfer's loop."""
    gloo_scenarios._quiet_logs()
    gloo_scenarios._LOOP.update(
        tune=gloo_scenarios._real_loop, entries=gloo_scenarios._held_entries
    )
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        tmp = Path(root) / name
        if rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        started = time.monotonic()
        try:
            scenario = OWN.get(name) or gloo_scenarios.SCENARIOS[name]
            out = scenario(rank, world, tmp)
        except Exception:  # noqa: BLE001
            out = {"error": traceback.format_exc()}
        out["seconds"] = time.monotonic() - started
        results[name] = out
    return results
