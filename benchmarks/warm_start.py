"""Warm-start benchmark: ficache's protocol side by side with the JSON-file protocol.

The peer is what vLLM 0.27-0.31 did at every start: rank 0 reads the one
cache file, broadcasts its bytes, every rank writes them to its own file,
barrier, every rank calls ``AutoTuner.load_configs``, the autotune process
group is set around the (here empty) tuning block, and a final barrier.

ficache's side is a full ``ficache.warm_start`` with nothing to tune: agree
on the environment, export every rank's slice from the SQLite registry,
scatter, load, confirm, set the tuning group, then the exit status exchange.

Both run on the same 4 gloo ranks (one process each) in the same processes,
alternating, on the same entries (the file is what ``save_configs`` writes
for the registry's slice). Figures are the slowest rank's wall time per
start; medians over ``--reps``. The first ficache start after a registry
change renders the slices from SQL (column "ficache, first"); later starts
read the slice cache. Target: ficache's median at most 1.0x the file
protocol's at 10k entries. ficache's tuner adapter pauses Python's garbage
collector while ``load_configs`` runs (a full collection over torch's heap
triggered halfway costs 0.1-0.4 s at 10k entries); the peer as vLLM wrote
it does not, so the file protocol is also timed with the same pause
("file+gc pause") and both ratios are printed. Rank 0's served mark
(``ficache.usage.mark_served``: one UPDATE; on a SQLite file its
connection's close folds the WAL, a few fsyncs) is written on a thread of
its own once the start returns (``mark_served_after_start``), so it is in no
rank's time; each rank waits for it after the timed start
(``wait_for_served_marks``, untimed) so that its fsyncs never fall into the
next start's time, the peer's included. Its own duration is timed by
wrapping it (benchmark instrumentation: the real function, timed) and
printed after the phases.
Nothing here asserts: it prints.

    python benchmarks/warm_start.py                      # 1k, 10k, 100k entries, 4 ranks
    python benchmarks/warm_start.py --sizes 1000 --reps 3
    python benchmarks/warm_start.py --sizes 100000 --records 1000   # with namespaced records
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
RECORDS_NS = "trtllm_moe_da"
OPS = ("flashinfer::mm_bf16", "flashinfer::trtllm_fp8_block_scale_moe", "flashinfer::cudnn_gemm")


def synthetic_rows(n: int) -> list[tuple[str, str, str, str]]:
    """``n`` entries shaped like FlashInfer's (key, runner, tactic, policy)."""
    from ficache.flashinfer_format import canonical_json

    rows = []
    for i in range(n):
        op = OPS[i % len(OPS)]
        runner = f"Runner{i % 7}"
        shapes = ((1 << (i % 14), 4096 + i // 14), (4096 + i // 14, 7168))
        key = str((op, runner, shapes, ("torch.bfloat16", i % 3)))
        rows.append((key, runner, canonical_json([i % 11, [i % 5, 2]]), canonical_json(POLICY)))
    return rows


def synthetic_records(n: int) -> dict[str, dict[str, str]]:
    """``n`` namespaced records shaped like FlashInfer's fused-MoE runtime's, as canonical JSON."""
    from ficache.flashinfer_format import canonical_json

    return {
        RECORDS_NS: {
            canonical_json({"custom_op": "moe", "num_tokens": i}): canonical_json(
                {"schema": 1, "bodies": [{"tile_n": 8 << (i % 4), "tactic": [i % 9, [1, 2]]}]}
            )
            for i in range(n)
        }
    }


def _prepare(workdir: Path, n: int, n_records: int = 0) -> tuple[str, str]:
    """Rank 0: a registry with ``n`` shared entries (and ``n_records`` shared records) and
    the equivalent FlashInfer file."""
    from flashinfer.autotuner import AutoTuner

    from ficache.fingerprint import collect
    from ficache.flashinfer_format import render_cache
    from ficache.records import NewRecord
    from ficache.registry import NewEntry, Registry

    fp = collect()
    rows = synthetic_rows(n)
    records = synthetic_records(n_records) if n_records else {}
    db = workdir / f"registry-{n}.db"
    with Registry.open(str(db)) as reg:
        reg.write(
            (NewEntry(fp, k, r, t, p) for k, r, t, p in rows),
            kind="import",
            message="benchmark",
            records=[
                NewRecord(fp, ns, key, value)
                for ns, by_key in records.items()
                for key, value in by_key.items()
            ],
        )
    # The peer's file, exactly as FlashInfer writes it (save_configs, indent=2).
    rendered = workdir / f"rendered-{n}.json"
    rendered.write_text(render_cache(fp.flashinfer_metadata(), rows, records))
    tuner = AutoTuner.get()
    tuner.clear_cache()
    assert tuner.load_configs(str(rendered))
    path = workdir / f"autotune-{n}.json"
    tuner.save_configs(str(path))
    tuner.clear_cache()
    return str(db), str(path)


def file_protocol_start(group: Any, path: str, workdir: Path, gc_pause: bool = False) -> None:
    """vLLM 0.27-0.31: broadcast one JSON file from rank 0, load it everywhere.

    ``gc_pause`` pauses Python's garbage collector around ``load_configs`` as
    ficache's adapter does (vLLM does not): reported as its own column, so
    the ratio is not read as coming from the protocol alone.
    """
    import gc

    import torch.distributed as dist
    from flashinfer.autotuner import AutoTuner, set_autotune_process_group

    rank = dist.get_rank(group)
    tuner = AutoTuner.get()
    tuner.clear_cache()
    data = [Path(path).read_bytes() if rank == 0 else None]
    dist.broadcast_object_list(data, group=group, group_src=0)
    local = workdir / f"rank{rank}-autotune.json"
    local.write_bytes(data[0])  # type: ignore[arg-type]
    dist.barrier(group)
    if gc_pause:
        gc.disable()
    try:
        tuner.load_configs(str(local))
    finally:
        if gc_pause:
            gc.enable()
    set_autotune_process_group(group)
    try:
        pass  # the tuning block: nothing to tune
    finally:
        set_autotune_process_group(None)
    dist.barrier(group)


#: Benchmark instrumentation: seconds of each ``mark_served`` call in this process
#: (``_timed_mark_served``; rank 0 marks on a thread of its own once a start returned).
MARK_SECONDS: list[float] = []


def _timed_mark_served(original: Callable[..., bool]) -> Callable[..., bool]:
    """``ficache.usage.mark_served`` as is, timed into ``MARK_SECONDS``."""

    def timed(*args: Any, **kwargs: Any) -> bool:
        start = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            MARK_SECONDS.append(time.perf_counter() - start)

    return timed


def ficache_start(group: Any, db: str, slice_cache: bool = True) -> dict[str, Any]:
    from ficache.sync import warm_start

    with warm_start(group, db=db, timeout=600, slice_cache=slice_cache) as ws:
        pass  # the tuning block: nothing to tune
    report = ws.report
    assert report.loaded > 0 and report.tuned == 0 and report.records_tuned == 0, report
    return ws.report.as_json()


def bench_rank(
    rank: int, world: int, sizes: list[int], reps: int, root: str, n_records: int = 0
) -> dict[str, Any]:
    import logging

    import torch
    import torch.distributed as dist

    logging.getLogger("flashinfer").setLevel(logging.ERROR)
    logging.getLogger("alembic").setLevel(logging.ERROR)
    import os

    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    workdir = Path(root)
    # Both protocols need FlashInfer imported; do it (and ficache's imports) before timing.
    import ficache.usage
    from ficache.fingerprint import collect
    from ficache.sync import warm_start  # noqa: F401

    collect()
    # The mark's thread calls ficache.usage.mark_served by its module name: the wrapper is seen.
    ficache.usage.mark_served = _timed_mark_served(ficache.usage.mark_served)
    results: dict[str, Any] = {}

    def slowest(seconds: float) -> float:
        t = torch.tensor([seconds], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t.item())

    def timed(fn: Any, *args: Any, **kwargs: Any) -> tuple[float, Any]:
        dist.barrier()
        start = time.perf_counter()
        out = fn(*args, **kwargs)
        return slowest(time.perf_counter() - start), out

    for n in sizes:
        paths = [_prepare(workdir, n, n_records) if rank == 0 else None]
        dist.broadcast_object_list(paths, group_src=0)
        db, path = paths[0]  # type: ignore[misc]
        file_s: list[float] = []
        file_gc_s: list[float] = []
        fic_s: list[float] = []
        phases: list[dict[str, float]] = []
        marks: list[float] = []
        first, _ = timed(ficache_start, None, db)  # renders the slices, fills the slice cache
        ficache.usage.wait_for_served_marks()
        nocache = []
        for _ in range(max(reps // 3, 1)):
            nocache.append(timed(ficache_start, None, db, slice_cache=False)[0])
            ficache.usage.wait_for_served_marks()
        timed(file_protocol_start, None, path, workdir)  # warm the page cache alike
        for rep in range(reps):
            order = (
                ("file", "ficache", "file_gc") if rep % 2 == 0 else ("file_gc", "ficache", "file")
            )
            for which in order:
                if which == "file":
                    file_s.append(timed(file_protocol_start, None, path, workdir)[0])
                elif which == "file_gc":
                    file_gc_s.append(
                        timed(file_protocol_start, None, path, workdir, gc_pause=True)[0]
                    )
                else:
                    MARK_SECONDS.clear()
                    seconds, report = timed(ficache_start, None, db)
                    ficache.usage.wait_for_served_marks()  # untimed: off every start's time
                    fic_s.append(seconds)
                    phases.append(report["seconds"])
                    marks.append(sum(MARK_SECONDS))
        results[str(n)] = {
            "entries": n,
            "file_bytes": Path(path).stat().st_size,
            "file_median_s": statistics.median(file_s),
            "file_gc_paused_median_s": statistics.median(file_gc_s),
            "ficache_median_s": statistics.median(fic_s),
            "ficache_first_s": first,
            "ficache_no_slice_cache_median_s": statistics.median(nocache),
            "file_s": file_s,
            "ficache_s": fic_s,
            "ficache_phases_median_s": {
                k: statistics.median(p.get(k, 0.0) for p in phases) for k in phases[0]
            }
            if phases
            else {},
            "ficache_served_mark_median_s": statistics.median(marks) if marks else 0.0,
        }
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", default="1000,10000,100000", help="comma-separated entry counts")
    parser.add_argument(
        "--reps", type=int, default=11, help="starts per protocol and size (median)"
    )
    parser.add_argument("--world", type=int, default=4, help="gloo ranks (processes)")
    parser.add_argument(
        "--records", type=int, default=0, help="namespaced records stored with the entries"
    )
    parser.add_argument("--json", action="store_true", help="print the raw figures as JSON too")
    args = parser.parse_args(argv)
    sizes = [int(s) for s in args.sizes.split(",") if s]

    from ficache._ranks import run_ranks

    with tempfile.TemporaryDirectory(prefix="ficache-bench-") as root:
        started = time.perf_counter()
        results = run_ranks(
            bench_rank,
            args.world,
            sizes,
            args.reps,
            root,
            args.records,
            timeout=3600,
            group_timeout=900,
        )[0]
        wall = time.perf_counter() - started
    print(
        f"warm start with nothing to tune, {args.world} gloo ranks, median of {args.reps} starts "
        f"(slowest rank), {wall:.0f} s in all"
    )
    header = (
        f"{'entries':>8} {'file KiB':>9} {'file protocol':>14} {'ficache':>10} {'ratio':>6} "
        f"{'file+gc pause':>14} {'ratio':>6} {'ficache, first':>15} {'no slice cache':>15}"
    )
    print(header)
    for n in sizes:
        r = results[str(n)]
        ratio = r["ficache_median_s"] / r["file_median_s"]
        ratio_gc = r["ficache_median_s"] / r["file_gc_paused_median_s"]
        print(
            f"{n:>8} {r['file_bytes'] / 1024:>9.0f} {r['file_median_s'] * 1e3:>11.1f} ms "
            f"{r['ficache_median_s'] * 1e3:>7.1f} ms {ratio:>5.2f}x "
            f"{r['file_gc_paused_median_s'] * 1e3:>11.1f} ms {ratio_gc:>5.2f}x "
            f"{r['ficache_first_s'] * 1e3:>12.1f} ms {r['ficache_no_slice_cache_median_s'] * 1e3:>12.1f} ms"
        )
    for n in sizes:
        phases = results[str(n)]["ficache_phases_median_s"]
        mark_ms = results[str(n)]["ficache_served_mark_median_s"] * 1e3
        print(
            f"ficache phases at {n} entries (rank 0, median ms): "
            + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in phases.items())
            + f"; the served mark, on its own thread after the start {mark_ms:.1f}"
        )
    if args.json:
        print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
