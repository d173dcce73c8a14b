"""Warm starts on groups smaller than the world: two 2-rank groups of a 4-rank gloo job.

The shape of vLLM's tensor-parallel groups under pipeline parallelism 2:
global ranks {0, 1} and {2, 3}, each group made with
``torch.distributed.new_group`` (every rank makes both, in the same order, as
``new_group`` requires), and each group runs ``ficache.warm_start`` on its
own group, with one registry shared by both. ``tests/test_subgroups.py``
runs ``run_plan`` through ``ficache._ranks.run_ranks`` (a hard timeout) and
asserts on what each rank returns.

Phases (each rank runs every phase in order):

- ``alone``: group A starts cold and commits (12 keys) while group B's ranks
  wait outside any collective (polling for a file rank 0 writes after its
  start, at most ``GROUP_TIMEOUT``). Had A's protocol issued one collective
  on the world (or on B's group), A would have waited out its 60 s timeout
  and reported it. Then B starts on the same registry: it loads A's 12,
  tunes 6 more, and commits them.
- ``together``: both groups start cold at the same moment on a fresh
  registry, tune the same 18 keys, and race to commit them. Every rank waits
  inside its block, after tuning, until all four have tuned (files, no
  collective), so both groups exported before either commits.
- ``again``: both groups start again, together, on that registry: every rank
  loads all 18 and tunes nothing.
- ``flashinfer`` (with ``real_loop=True``): ``together`` and ``again`` once
  more on a third registry, tuning through FlashInfer's real ``choose_one``
  loop (``ficache.standin_timing``) on each 2-rank group.

Each start records the tuning group FlashInfer saw inside the block (its
global ranks), and every commit's provenance names the global rank that
made it (``provenance={"global_rank": ...}``: only the group's rank 0
commits, with its own provenance).
"""

from __future__ import annotations

import os
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import gloo_scenarios
import torch.distributed as dist
from gloo_scenarios import GROUP_TIMEOUT, SHAPES_A, start

from ficache.standin import DEFAULT_SHAPES

GROUPS = ((0, 1), (2, 3))
LAYOUT = "tp2-pp2-dp1-ep1"
SHAPES_B = DEFAULT_SHAPES[1:]  # 12 keys, 6 of them A's


def _tuning_group_ranks(seen: dict[str, Any]) -> None:
    """Inside the block: the global ranks of the group FlashInfer all-reduces over."""
    from flashinfer.autotuner import get_autotune_process_group

    group = get_autotune_process_group()
    seen["tuning_group"] = None if group is None else dist.get_process_group_ranks(group)


def _rendezvous(directory: Path, world: int) -> bool:
    """Wait (no collective, at most GROUP_TIMEOUT) until every rank of the job got here."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / f"rank{dist.get_rank()}").write_text("here\n")
    deadline = time.monotonic() + GROUP_TIMEOUT
    while time.monotonic() < deadline:
        if len(list(directory.iterdir())) >= world:
            return True
        time.sleep(0.05)
    return False


def _start(db: Any, group: Any, together: Path | None = None, **kwargs: Any) -> dict[str, Any]:
    """One warm start of this rank's group. ``together``: every rank of the job waits there
    after tuning, inside its block, so both groups exported before either commits."""
    seen: dict[str, Any] = {}

    def after_tuning() -> None:
        _tuning_group_ranks(seen)
        if together is not None:
            seen["met"] = _rendezvous(together, len(GROUPS) * 2)

    out = start(
        db,
        group=group,
        layout=LAYOUT,
        provenance={"global_rank": dist.get_rank()},
        fail=after_tuning,
        **kwargs,
    )
    out.update(seen)
    return out


def _wait_for(path: Path) -> bool:
    """Poll for ``path`` (no collective), at most GROUP_TIMEOUT seconds."""
    deadline = time.monotonic() + GROUP_TIMEOUT
    while time.monotonic() < deadline:
        if path.exists():
            return True
        time.sleep(0.05)
    return False


def commits(db: Any) -> list[dict[str, Any]]:
    """Every commit of ``db``: id, counts, the global rank that made it, its change-log size."""
    from ficache.registry import Registry

    with Registry.open(str(db), create=False) as reg:
        return [
            {
                "id": c.id,
                "added": c.added,
                "replaced": c.replaced,
                "global_rank": c.provenance.get("global_rank"),
                "layout": c.layout,
                "world_size": c.world_size,
            }
            for c in reg.log(limit=None)
        ]


def stored(db: Any) -> dict[str, Any]:
    """``{scope: {key: tactic_json}}`` of every stored entry."""
    from ficache.registry import Registry

    out: dict[str, dict[str, str]] = {}
    with Registry.open(str(db), create=False) as reg:
        for entry in reg.entries():
            out.setdefault(entry.scope, {})[entry.key] = entry.tactic_json
    return out


def verify_clean(db: Any) -> bool:
    from ficache.verify import verify

    return bool(verify(str(db)).ok)


def run_plan(
    rank: int, world: int, root: str, db_url: str | None = None, real_loop: bool = False
) -> dict[str, Any]:
    """This rank's results of every phase (see the module docstring)."""
    gloo_scenarios._quiet_logs()
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    timeout = timedelta(seconds=GROUP_TIMEOUT)
    groups = [dist.new_group(list(ranks), timeout=timeout, backend="gloo") for ranks in GROUPS]
    mine = groups[rank // 2]
    leader = rank % 2 == 0
    tmp = Path(root)
    out: dict[str, Any] = {"group": list(GROUPS[rank // 2]), "group_rank": dist.get_rank(mine)}

    # alone: A while B is outside every collective, then B.
    alone = tmp / "alone.db"
    signal = tmp / "a-done"
    if rank < 2:
        out["alone"] = _start(alone, mine, tune={"shapes": SHAPES_A})
        dist.barrier(group=mine)  # both of A's ranks are done
        if rank == 0:
            signal.write_text("done\n")
    else:
        out["waited_for_a"] = _wait_for(signal)
        out["alone"] = _start(alone, mine, tune={"shapes": SHAPES_B})
    dist.barrier()
    if rank == 0:
        out["alone_commits"] = commits(alone)
        out["alone_stored"] = stored(alone)

    # together, then again: both groups at once on one registry.
    shared = db_url or tmp / "together.db"
    dist.barrier()
    out["together"] = _start(shared, mine, together=tmp / "together-tuned")
    dist.barrier()
    out["again"] = _start(shared, mine)
    dist.barrier()
    if rank == 0:
        out["together_commits"] = commits(shared)
        out["together_stored"] = stored(shared)
        out["together_verify_clean"] = verify_clean(shared)

    if real_loop:
        gloo_scenarios._LOOP.update(
            tune=gloo_scenarios._real_loop, entries=gloo_scenarios._held_entries
        )
        real = tmp / "flashinfer.db"
        dist.barrier()
        out["fi_together"] = _start(real, mine, together=tmp / "fi-together-tuned")
        dist.barrier()
        out["fi_again"] = _start(real, mine)
        dist.barrier()
        if rank == 0:
            out["fi_commits"] = commits(real)
            out["fi_stored"] = stored(real)
            out["fi_verify_clean"] = verify_clean(real)
    if leader:
        out["leader"] = True
    del groups, mine
    return out
