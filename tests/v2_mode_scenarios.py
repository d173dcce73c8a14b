"""v2-mode warm starts on real gloo ranks, tuning through FlashInfer's REAL ``autotune_v2``.

``tests/test_v2_mode.py`` runs ``run_plan`` on 2 and 4 ranks
(``ficache._ranks.run_ranks``, a hard timeout). Only CUDA timing is stood in
(``ficache.standin_timing``); the managed store, its publishes, preload and
``autotune_v2_reload`` are FlashInfer's own.

- ``pr55671``: the block is shaped like vLLM PR #55671's warmup: the
  autotune process group set (the tuning group the start set: vLLM sets its
  own, which under the plugin is the same ranks), ``autotune_v2(mode="tune",
  cache_root=<a node-local root>, skip_ops=...)`` around the tuning, then
  barrier, ``autotune_v2_reload()``, barrier, on every rank. Cold, warm, half
  of the registry deleted, then a start whose rank 1 raises mid-tuning.
- ``ambient``: a managed store is attached before the start (vLLM 0.33's
  sparse-MLA warmup opens one before ``flashinfer_autotune`` runs), and only
  rank 0's holds entries (a node-local store only some ranks hit); the block
  tunes through FlashInfer's v1 loop (``autotune(True)``), as vLLM 0.33's v1
  path does. The same four starts, with ``warm_start``'s defaults.
- ``policy_cold`` / ``policy_warm`` (each in fresh processes): the
  ``pr55671`` block with ``autotune_v2(measurement_policy=BLOCK_POLICY)`` (a
  policy other than the default, as a framework that names its serving mode
  passes), under ``warm_start(v2=True)`` with no measurement policy (the
  vLLM plugin's start); ``policy_cold`` also exports the registry as a v2
  store (``plan_v2_export``, what ``export --v2-store`` writes).
- ``policy_explicit``: the same block, under ``warm_start(measurement_policy=
  MeasurementPolicy())`` (the caller names the default policy explicitly).
- ``policy_mix``: one registry, one environment, two policies: a cold start
  whose block tunes under ``block_policy()`` and names it, then a cold start
  whose block tunes under the default policy and names that; half of the
  default policy's entries are deleted; then a warm start under each policy.
  Each start is served its own policy's entries (``Fingerprint.measurement``).
"""

from __future__ import annotations

import os
import time
import traceback
from pathlib import Path
from typing import Any

import gloo_scenarios
import torch.distributed as dist
from gloo_scenarios import SHAPES_A, _sql, registry_summary

from ficache.standin import DEFAULT_SHAPES
from ficache.sync import warm_start

SKIP_OPS = {"ficache::an_op_this_warmup_never_runs"}


def _tune(fail: bool) -> int:
    """Tune every stand-in shape through FlashInfer's loop, one ``choose_one`` batch per shape;
    raise after the first when ``fail`` (mid-tuning: the peers are in the next shape's
    all-reduces). Returns the winners FlashInfer profiled."""
    from ficache.standin_timing import real_loop_tune

    profiled = 0
    for index, shape in enumerate(DEFAULT_SHAPES):
        if fail and index == 1:
            raise RuntimeError("boom mid-tuning")
        profiled += real_loop_tune(shapes=[shape]).profiled
    return profiled


def block_policy() -> Any:
    """The measurement policy of the ``policy_*`` blocks: hot L2 forced (``cold_l2=False``),
    a non-default policy (its own ``measure_cold_l2`` manifest field) that FlashInfer 0.7.2.post1
    and 0.7.4 both have and whose profiling the CPU stand-in times as the default's."""
    from flashinfer.autotune_cache import MeasurementPolicy

    return MeasurementPolicy(cold_l2=False)


def _pr55671_block(node_root: Path, fail: bool, policy: Any = None) -> int:
    """The warmup as vLLM PR #55671 writes it (see the module docstring); ``policy``: the
    ``measurement_policy`` its ``autotune_v2`` passes, if any."""
    from flashinfer import autotune_v2, autotune_v2_reload
    from flashinfer.autotuner import get_autotune_process_group, set_autotune_process_group

    extra = {} if policy is None else {"measurement_policy": policy}
    set_autotune_process_group(get_autotune_process_group())
    try:
        with autotune_v2(mode="tune", cache_root=node_root, skip_ops=SKIP_OPS, **extra):
            profiled = _tune(fail)
    finally:
        set_autotune_process_group(None)
    dist.barrier()
    autotune_v2_reload()
    dist.barrier()
    return profiled


def _ambient_block(node_root: Path, fail: bool) -> int:
    return _tune(fail)


def _start(
    db: Path, block: Any, node_root: Path, fail: bool = False, **options: Any
) -> dict[str, Any]:
    out: dict[str, Any] = {"exception": None, "profiled": None}
    try:
        with warm_start(None, db=str(db), timeout=gloo_scenarios.GROUP_TIMEOUT, **options) as ws:
            out["v2_cache_root"] = str(ws.v2_cache_root)
            out["profiled"] = block(node_root, fail)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        out["exception"] = f"{type(exc).__name__}: {exc}"
    out["report"] = ws.report.as_json()
    return out


def _keys(db: Path) -> list[str]:
    return sorted(row[0] for row in _sql(db, "SELECT key FROM entries"))


def _four_starts(rank: int, tmp: Path, block: Any, node_root: Path) -> dict[str, Any]:
    db = tmp / "registry.db"
    out: dict[str, Any] = {"cold": _start(db, block, node_root)}
    out["after_cold"] = registry_summary(db)
    out["warm"] = _start(db, block, node_root)
    if rank == 0:
        out["deleted"] = sorted(
            row[0] for row in _sql(db, "SELECT key FROM entries WHERE id % 2 = 0")
        )
        _sql(db, "DELETE FROM entries WHERE id % 2 = 0")
    dist.barrier()
    out["half"] = _start(db, block, node_root)
    out["after_half"] = registry_summary(db)
    out["keys_after_half"] = _keys(db)
    # The registry loses half again (once every rank has read it); then rank 1 raises
    # mid-tuning.
    dist.barrier()
    if rank == 0:
        _sql(db, "DELETE FROM entries WHERE id % 2 = 1")
    dist.barrier()
    before = registry_summary(db)
    out["raise"] = _start(db, block, node_root, fail=rank == 1)
    out["before_raise"], out["after_raise"] = before, registry_summary(db)
    return out


def pr55671(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    node_root = tmp / f"node-local-rank{rank}"
    return _four_starts(rank, tmp, _pr55671_block, node_root)


def ambient(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """A store attached before the start; only rank 0's holds entries (tuned alone)."""
    from flashinfer import autotune_v2
    from flashinfer.autotuner import AutoTuner

    from ficache.standin_timing import real_loop_tune

    node_root = tmp / f"node-local-rank{rank}"
    with autotune_v2(mode="tune", cache_root=node_root):
        if rank == 0:
            real_loop_tune(shapes=SHAPES_A, sync=False)
    out = {"attached_before": str(AutoTuner.get()._managed_cache.root)}
    out.update(_four_starts(rank, tmp, _ambient_block, node_root))
    return out


def _policy_block(node_root: Path, fail: bool) -> int:
    return _pr55671_block(node_root, fail, block_policy())


def _commits(db: Path) -> list[dict[str, Any]]:
    from ficache.registry import Registry

    with Registry.open(str(db)) as reg:
        return [{"kind": c.kind, "provenance": c.provenance} for c in reg.log(None)]


def policy_cold(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """A cold start whose block tunes under ``block_policy()``; rank 0 then exports the
    registry's fingerprint as a v2 store."""
    from ficache.exporting import plan_v2_export

    db = tmp / "registry.db"
    out: dict[str, Any] = {"cold": _start(db, _policy_block, tmp / f"node-{rank}", v2=True)}
    out["after_cold"] = registry_summary(db)
    if rank == 0 and _commits(db):  # nothing to export without a commit
        from ficache.registry import Registry

        out["commits"] = _commits(db)
        with Registry.open(str(db)) as reg:
            export = plan_v2_export(reg, 1)
        export.write(tmp / "exported")
        out["exported_measurement"] = dict(export.measurement)
        out["exported_envs"] = sorted(p.name for p in (tmp / "exported" / "v2").iterdir())
    return out


def policy_warm(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """``policy_cold``'s start again, in fresh processes, on its registry."""
    db = tmp.parent / "policy_cold" / "registry.db"
    out: dict[str, Any] = {"warm": _start(db, _policy_block, tmp / f"node-{rank}", v2=True)}
    out["after_warm"] = registry_summary(db)
    return out


def policy_explicit(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """The ``block_policy()`` block under a start given the default policy explicitly."""
    from flashinfer.autotune_cache import MeasurementPolicy

    db = tmp / "registry.db"
    out: dict[str, Any] = {
        "cold": _start(
            db,
            _policy_block,
            tmp / f"node-{rank}",
            v2=True,
            measurement_policy=MeasurementPolicy(),
        )
    }
    out["after_cold"] = registry_summary(db)
    return out


def _fingerprints(db: Path) -> list[tuple[Any, ...]]:
    """``(id, digest, measurement)`` of every fingerprint (measurement None before 0010, so
    the scenario runs, and its test fails on what it checks, on the code before it)."""
    columns = {row[1] for row in _sql(db, "PRAGMA table_info(fingerprints)")}
    measurement = "measurement" if "measurement" in columns else "NULL"
    return [tuple(r) for r in _sql(db, f"SELECT id, digest, {measurement} FROM fingerprints")]


def _entries_by_fingerprint(db: Path) -> dict[int, int]:
    return {
        int(fid): int(n)
        for fid, n in _sql(db, "SELECT fingerprint_id, count(*) FROM entries GROUP BY 1")
    }


def policy_mix(rank: int, world: int, tmp: Path) -> dict[str, Any]:
    """Two policies in one registry (module docstring): each start names its policy."""
    from flashinfer.autotune_cache import MeasurementPolicy

    db = tmp / "registry.db"
    policy, default = block_policy(), MeasurementPolicy()
    out: dict[str, Any] = {}
    out["cold_policy"] = _start(
        db, _policy_block, tmp / f"a-{rank}", v2=True, measurement_policy=policy
    )
    out["cold_default"] = _start(
        db, _pr55671_block, tmp / f"b-{rank}", v2=True, measurement_policy=default
    )
    out["fingerprints"] = _fingerprints(db)
    out["entries"] = _entries_by_fingerprint(db)
    dist.barrier()
    if rank == 0:  # half of the default policy's entries (its fingerprint: the last one)
        last = max(fid for fid, *_rest in out["fingerprints"])
        out["deleted"] = _sql(
            db, f"SELECT count(*) FROM entries WHERE fingerprint_id = {last} AND id % 2 = 0"
        )[0][0]
        _sql(db, f"DELETE FROM entries WHERE fingerprint_id = {last} AND id % 2 = 0")
    dist.barrier()
    out["warm_policy"] = _start(
        db, _policy_block, tmp / f"c-{rank}", v2=True, measurement_policy=policy
    )
    out["warm_default"] = _start(
        db, _pr55671_block, tmp / f"d-{rank}", v2=True, measurement_policy=default
    )
    out["entries_after"] = _entries_by_fingerprint(db)
    return out


SCENARIOS = {
    f.__name__: f for f in (pr55671, ambient, policy_cold, policy_warm, policy_explicit, policy_mix)
}


def run_plan(rank: int, world: int, root: str, names: list[str]) -> dict[str, dict[str, Any]]:
    """Run the named scenarios in order on this rank."""
    gloo_scenarios._quiet_logs()
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    results: dict[str, dict[str, Any]] = {}
    for name in names:
        tmp = Path(root) / name
        if rank == 0:
            tmp.mkdir(parents=True, exist_ok=True)
        dist.barrier()
        started = time.monotonic()
        try:
            out = SCENARIOS[name](rank, world, tmp)
        except Exception:  # noqa: BLE001
            out = {"error": traceback.format_exc()}
        out["seconds"] = time.monotonic() - started
        results[name] = out
    return results
