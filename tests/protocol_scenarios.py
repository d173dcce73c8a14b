"""Warm starts that serve and harvest FlashInfer 0.7.4's protocol records, on real gloo ranks.

``tests/test_protocol_start.py`` runs ``cold`` and then, in fresh processes,
``warm_then_one_deleted`` through ``ficache._ranks.run_ranks`` (a hard
timeout), on 2 and 4 ranks, and ``one_rank_raises_mid_block`` on 2 ranks.
Each runs two paths, each with its own registry:

- ``v1``: the block tunes through FlashInfer's v1 loop (``autotune(True)``),
  where FlashInfer keeps protocol records in memory only, never in a cache
  file;
- ``v2``: the block is shaped like vLLM PR #55671's warmup (``autotune_v2(
  mode="tune", cache_root=<a node-local root>)``, then barrier,
  ``autotune_v2_reload()``, barrier), where FlashInfer persists them in the
  managed store.

In both the block tunes the stand-in op through FlashInfer's real
``choose_one`` (only CUDA timing stood in, ``ficache.standin_timing``) and
runs ``ficache.standin_protocol`` (a stand-in for a MoE-EP MegaMoE
protocol, named as one: it measures nothing; rank 0 publishes a value for
every key it misses, the other ranks publish nothing) through FlashInfer's
real ``choose_with_protocol``.
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import gloo_scenarios
import torch.distributed as dist
from gloo_scenarios import SHAPES_A, _sql

from ficache.standin_protocol import KEYS, run_standin_protocol
from ficache.standin_protocol import NAMESPACE as NS
from ficache.sync import warm_start

#: What rank 1 raises in ``_raising_block``.
BOOM = "boom mid-block"


def _block(path: str, rank: int, node_root: Path, out: dict[str, Any]) -> None:
    """Tune, then run the stand-in protocol, under the path's context, filling ``out``
    (``seen``, ``hits``, ``published``)."""
    from flashinfer import autotune
    from flashinfer.autotuner import AutoTuner

    from ficache.standin_timing import real_loop_tune

    out["seen"] = AutoTuner.get().get_protocol_records(NS)
    if path == "v1":
        real_loop_tune(shapes=SHAPES_A)
        with autotune(True):
            protocol = run_standin_protocol(rank)
    else:
        from flashinfer import autotune_v2, autotune_v2_reload

        with autotune_v2(mode="tune", cache_root=node_root):
            real_loop_tune(shapes=SHAPES_A)
            protocol = run_standin_protocol(rank)
        dist.barrier()
        autotune_v2_reload()
        dist.barrier()
    out.update(hits=protocol.hits, published=protocol.published)


def _raising_block(path: str, rank: int, node_root: Path, out: dict[str, Any]) -> None:
    """The protocol first (rank 0 publishes what it misses), then tuning shape by shape,
    where rank 1 raises ``BOOM`` at the second shape: rank 0 is then in one of that shape's
    tuning all-reduces, from which the start's release frees it. (A rank raising after the
    tuning instead would leave its peer in the v2 path's ``dist.barrier()``, a collective
    of the caller's group that no start can release: it waits out that group's timeout.)"""
    from flashinfer import autotune

    from ficache.standin_timing import real_loop_tune

    def protocol_then_tuning() -> None:
        protocol = run_standin_protocol(rank)
        out.update(hits=protocol.hits, published=protocol.published)
        for index, shape in enumerate(SHAPES_A):
            if rank == 1 and index == 1:
                raise RuntimeError(BOOM)
            real_loop_tune(shapes=[shape])

    if path == "v1":
        with autotune(True):
            protocol_then_tuning()
    else:
        from flashinfer import autotune_v2, autotune_v2_reload

        with autotune_v2(mode="tune", cache_root=node_root):
            protocol_then_tuning()
        dist.barrier()
        autotune_v2_reload()
        dist.barrier()


def _start(path: str, rank: int, tmp: Path, block: Any = _block) -> dict[str, Any]:
    from flashinfer.autotuner import AutoTuner

    out: dict[str, Any] = {"exception": None}
    db = tmp / f"{path}.db"
    try:
        with warm_start(None, db=str(db), timeout=gloo_scenarios.GROUP_TIMEOUT) as ws:
            block(path, rank, tmp / f"node-local-{path}-rank{rank}", out)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["exception"] = f"{type(exc).__name__}: {exc}"
    out["report"] = ws.report.as_json()
    out["held_after"] = AutoTuner.get().get_protocol_records(NS)
    return out


def stored(db: Path) -> list[tuple[Any, ...]]:
    """``(scope, namespace, key, value)`` of every stored protocol record, in key order."""
    return _sql(db, "SELECT scope, namespace, key, value FROM protocol_records ORDER BY key")


def registry_state(db: Path) -> dict[str, Any]:
    """What a start that commits nothing must leave as it was: every commit, entry and
    protocol record row."""
    return {
        "commits": _sql(db, "SELECT id, kind FROM commits ORDER BY id"),
        "entries": _sql(db, "SELECT scope, key, runner, tactic FROM entries ORDER BY scope, key"),
        "protocol_records": stored(db),
    }


def _run(rank: int, root: str, steps: Any) -> dict[str, Any]:
    gloo_scenarios._quiet_logs()
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    tmp = Path(root)
    started = time.monotonic()
    try:
        out = steps(rank, tmp)
    except Exception:  # noqa: BLE001
        out = {"error": traceback.format_exc()}
    out["seconds"] = time.monotonic() - started
    return out


def cold(rank: int, world: int, root: str) -> dict[str, Any]:
    """The first start of each path on an empty registry."""

    def steps(rank: int, tmp: Path) -> dict[str, Any]:
        from ficache.verify import verify

        out: dict[str, Any] = {}
        for path in ("v1", "v2"):
            out[path] = _start(path, rank, tmp)
            out[f"{path}_verified"] = verify(str(tmp / f"{path}.db")).ok if rank == 0 else None
        return out

    return _run(rank, root, steps)


def warm_then_one_deleted(rank: int, world: int, root: str) -> dict[str, Any]:
    """In fresh processes: a warm start of each path, then (rank 0 deletes one protocol
    record of each registry) another."""

    def steps(rank: int, tmp: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path in ("v1", "v2"):
            out[path] = _start(path, rank, tmp)
        if rank == 0:
            for path in ("v1", "v2"):
                _sql(tmp / f"{path}.db", f"DELETE FROM protocol_records WHERE key = '{KEYS[1]}'")
        dist.barrier()
        for path in ("v1", "v2"):
            out[f"{path}_deleted"] = _start(path, rank, tmp)
            out[f"{path}_stored"] = stored(tmp / f"{path}.db")
        out["heavy_modules"] = sorted(m for m in ("sqlalchemy", "alembic") if m in sys.modules)
        return out

    return _run(rank, root, steps)


def one_rank_raises_mid_block(rank: int, world: int, root: str) -> dict[str, Any]:
    """A cold start of each path; then, once rank 0 deleted every entry and one protocol
    record of each registry, a start of each path (``_raising_block``) whose rank 0
    publishes that record again in the block while rank 1 raises in it. Rank 0 reads each
    registry before and after."""

    def steps(rank: int, tmp: Path) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for path in ("v1", "v2"):
            out[path] = _start(path, rank, tmp)
        if rank == 0:
            for path in ("v1", "v2"):
                db = tmp / f"{path}.db"
                _sql(db, "DELETE FROM entries")
                _sql(db, f"DELETE FROM protocol_records WHERE key = '{KEYS[1]}'")
        dist.barrier()
        for path in ("v1", "v2"):
            db = tmp / f"{path}.db"
            before = registry_state(db) if rank == 0 else None
            out[f"{path}_raise"] = _start(path, rank, tmp, _raising_block)
            out[f"{path}_before"] = before
            out[f"{path}_after"] = registry_state(db) if rank == 0 else None
        return out

    return _run(rank, root, steps)
