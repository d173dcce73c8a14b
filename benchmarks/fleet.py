"""Fleet benchmark: merging many hosts' FlashInfer cache files into one registry,
side by side with the floor, FlashInfer's own ``AutoTuner.load_configs`` of the
same files one after another in the same run.

    python benchmarks/fleet.py                    # 10 files of 10k entries
    python benchmarks/fleet.py --files 10 100     # also 100 files
    python benchmarks/fleet.py --large            # the same as --files 10 100

Each file holds ``--entries`` entries: half of its keys are shared by every
file (the ops every host tunes), half are its own; ``--conflicts`` percent of
a file's entries are shared keys with a tactic of the file's own. All files
carry this environment's ``_metadata``, so ``load_configs`` accepts them.

The merge figure is what ``ficache merge FILE...`` does: read and verify
every file, plan against the registry, and commit once (policy ``keep``,
into a fresh registry). The floor times only the ``load_configs`` calls, in
a child process that has imported FlashInfer: not the imports, not the
environment probe of the first call, not the cyclic collector (off while
they run, as ficache's own tuner calls ``load_configs``). Targets (2-core
machine): 10 files under 2 s, 100 files under 20 s. ``--reps N`` runs each
N times and prints medians. Nothing here asserts: it prints. Not run in CI.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ficache.merge import MergePlan, plan_merge, read_sources
from ficache.registry import Registry, WriteResult

POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
OPS = ("flashinfer::mm_bf16", "flashinfer::trtllm_fp8_block_scale_moe", "flashinfer::cudnn_gemm")


def _key(i: int, salt: int) -> str:
    """A FlashInfer-shaped key; ``salt`` separates files' own keys from shared ones."""
    op = OPS[i % len(OPS)]
    runner = f"Runner{i % 7}"
    shapes = ((1 << (i % 14), 4096 + i // 14), (4096 + i // 14, 7168 + salt))
    return str((op, runner, shapes, ("torch.bfloat16", i % 3)))


def fleet_file(host: int, entries: int, conflict_percent: float, metadata: dict[str, str]) -> str:
    """One host's cache file: half shared keys, half its own, a few shared ones conflicting."""
    shared = entries // 2
    conflicting = int(entries * conflict_percent / 100)
    data: dict[str, object] = {"_metadata": metadata}
    for i in range(shared):
        tactic = [i % 11, [i % 5, 2]]
        if i < conflicting:  # this host tuned these shared keys differently
            tactic = [100 + host, [i % 5, 2]]
        data[_key(i, 0)] = [f"Runner{i % 7}", tactic, POLICY]
    for i in range(entries - shared):
        data[_key(i, 1 + host)] = [f"Runner{i % 7}", [i % 11, [i % 5, 2]], POLICY]
    return json.dumps(data, indent=2)


# The floor runs in a child process: importing FlashInfer (and torch) grows
# the heap by millions of objects, which the merge, like `ficache merge`,
# never imports. Only the load_configs calls are timed: not the imports, not
# the environment's metadata that the first call collects (done before), and
# not the cyclic collector, which is off while they run (as ficache's own
# tuner calls load_configs). With it on, the calls' allocations set off full
# collections over millions of torch objects, which made the floor several
# times what load_configs itself costs.
_FLOOR = """
import gc, json, logging, sys, time
from flashinfer.autotuner import AutoTuner, _collect_metadata
from flashinfer.jit.core import logger
logger.setLevel(logging.WARNING)
if sys.argv[1] == "metadata":
    print(json.dumps(dict(_collect_metadata())))
    sys.exit(0)
_collect_metadata()
tuner = AutoTuner.get()
tuner.clear_cache()
gc.collect()
gc.disable()
t0 = time.perf_counter()
for path in sys.argv[1:]:
    if not tuner.load_configs(path):
        sys.exit(f"load_configs refused {path}; the floor would be wrong")
print(time.perf_counter() - t0)
"""


def _floor(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", _FLOOR, *args], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        raise SystemExit(done.stderr.strip().splitlines()[-1])
    return done.stdout


def merge_once(paths: list[Path], db: Path) -> tuple[dict[str, float], MergePlan, WriteResult]:
    """``ficache merge`` of ``paths`` into the registry ``db``: its phases' seconds."""
    gc.collect()  # start from a clean heap, as a fresh `ficache merge` process does
    t0, cpu0 = time.perf_counter(), time.process_time()
    sources = read_sources(paths)
    t_read = time.perf_counter() - t0
    with Registry.open(str(db)) as reg:
        t1 = time.perf_counter()
        plan = plan_merge(reg, sources, "keep")
        t_plan = time.perf_counter() - t1
        t2 = time.perf_counter()
        result = plan.execute(reg)
        t_commit = time.perf_counter() - t2
    seconds = {
        "merge": time.perf_counter() - t0,
        "cpu": time.process_time() - cpu0,  # on a shared machine, wall time includes waiting
        "read": t_read,
        "plan": t_plan,
        "commit": t_commit,
    }
    return seconds, plan, result


def bench(files: int, entries: int, conflict_percent: float, reps: int, tmp: Path) -> None:
    metadata = json.loads(_floor("metadata"))
    paths = []
    for host in range(files):
        path = tmp / f"host{host:03d}.json"
        path.write_text(fleet_file(host, entries, conflict_percent, metadata))
        paths.append(path)
    runs: list[dict[str, float]] = []
    for rep in range(reps):
        db = tmp / f"fleet-{files}-{rep}.db"
        Registry.open(str(db)).close()  # created outside the timing, as a registry exists
        floor = float(_floor(*map(str, paths)))
        seconds, plan, result = merge_once(paths, db)
        runs.append({**seconds, "floor": floor})
        db.unlink()
    med = {name: statistics.median(run[name] for run in runs) for name in runs[0]}
    target = 2.0 * max(files, 10) / 10
    print(
        f"merge {files:>3} files x {entries} entries: {med['merge']:6.2f} s "
        f"(cpu {med['cpu']:.2f}; read {med['read']:.2f}, plan {med['plan']:.2f}, "
        f"commit {med['commit']:.2f}); load_configs floor {med['floor']:5.2f} s; "
        f"ratio {med['merge'] / med['floor']:4.1f}x; target {target:.0f} s"
        + (
            f"  (medians of {reps}: merge {[round(r['merge'], 2) for r in runs]})"
            if reps > 1
            else ""
        )
    )
    print(
        f"    {plan.added} added, {plan.identical} identical, {plan.conflicting} conflicting "
        f"(kept), commit {result.commit_id}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--files", type=int, nargs="*", default=[10], help="file counts to merge")
    parser.add_argument("--large", action="store_true", help="merge 10 and 100 files")
    parser.add_argument("--entries", type=int, default=10_000, help="entries per file")
    parser.add_argument(
        "--conflicts", type=float, default=3.0, help="percent of a file's entries that conflict"
    )
    parser.add_argument("--reps", type=int, default=1, help="runs of each; medians are printed")
    args = parser.parse_args(argv)
    counts = [10, 100] if args.large else args.files
    with tempfile.TemporaryDirectory() as d:
        for n in counts:
            bench(n, args.entries, args.conflicts, args.reps, Path(d))
    return 0


if __name__ == "__main__":
    sys.exit(main())
