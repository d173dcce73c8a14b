"""Warm starts of this ficache on a registry at a previous release's schema, on real gloo ranks.

``tests/test_rolling_upgrade.py`` runs ``serve_and_commit`` through
``ficache._ranks.run_ranks`` (a hard timeout kills the ranks): a registry at
an older revision (a copy of a frozen file, or a PostgreSQL database migrated
to that revision and loaded with the frozen file's rows) stays there while
this code starts on it twice. Each start's block tunes the stand-in op
through FlashInfer's real ``choose_one`` (only CUDA timing stood in,
``ficache.standin_timing``) and runs the stand-in MoE-EP protocol
(``ficache.standin_protocol``, named as one: rank 0 publishes a protocol
record for every key it misses), as ``tests/protocol_scenarios.py``'s v1 path.
The first start is cold and commits its entries; the second serves them. Both
publish protocol records, which the older schema cannot hold.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path
from typing import Any

import gloo_scenarios
import protocol_scenarios

from ficache.sync import warm_start


def _start(db: str, rank: int, node_root: Path) -> dict[str, Any]:
    out: dict[str, Any] = {"exception": None}
    try:
        with warm_start(None, db=db, timeout=gloo_scenarios.GROUP_TIMEOUT) as ws:
            protocol_scenarios._block("v1", rank, node_root, out)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["exception"] = f"{type(exc).__name__}: {exc}"
    out["report"] = ws.report.as_json()
    gloo_scenarios.settled()
    return out


def serve_and_commit(rank: int, world: int, root: str, db: str) -> dict[str, Any]:
    """Two starts on ``db``: a cold one that commits, then one that serves what it committed."""
    gloo_scenarios._quiet_logs()
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    try:
        cold = _start(db, rank, Path(root) / f"node-cold-{rank}")
        warm = _start(db, rank, Path(root) / f"node-warm-{rank}")
    except Exception:  # noqa: BLE001
        return {"error": traceback.format_exc()}
    return {"cold": cold, "warm": warm}
