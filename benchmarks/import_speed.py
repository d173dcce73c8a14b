"""Import speed: parse and write one FlashInfer cache file into a registry,
side by side with FlashInfer's own ``AutoTuner.load_configs`` of the same file
(and ``json.load``), in one process.

    python benchmarks/import_speed.py                  # 10k entries, 9 rounds
    python benchmarks/import_speed.py --entries 100000 --reps 3
    python benchmarks/import_speed.py --selections     # values as FlashInfer 0.7.4 tunes them

Each round times, in turn: ``json.load`` of the file; ``load_configs`` into a
cleared AutoTuner, with the cyclic collector off and then on; ficache's
parse (``read_cache_file``: read, validate every entry, canonical JSON);
ficache's write (``Registry.import_cache`` of the parsed file into a fresh
SQLite registry, opened beforehand: one commit with its change log).
Figures are medians over the rounds. The target: parse + write at most 5x
``load_configs``, taken with the collector off (as ficache's own tuner calls
it), which is its own work alone: with the collector on, some of its calls
also pay for full collections over torch's heap. ``json.load`` runs with the
collector off too. ficache's side runs as shipped (it pauses the collector
itself).

FlashInfer and torch are imported first: ficache's parse must hold up in a
server process that has them. The file carries this environment's
``_metadata`` so ``load_configs`` accepts it. Nothing here asserts: it
prints.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import logging
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

from flashinfer.autotuner import AutoTuner, _collect_metadata
from flashinfer.jit.core import logger

from ficache.flashinfer_format import read_cache_file
from ficache.registry import Registry

POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]
T = TypeVar("T")

OPS = ("flashinfer::mm_bf16", "flashinfer::trtllm_fp8_block_scale_moe", "flashinfer::cudnn_gemm")


def cache_file(n: int, metadata: dict[str, str], selections: bool = False) -> str:
    """A cache file of ``n`` entries with keys as FlashInfer writes them; with
    ``selections``, each value ends with a selection, as FlashInfer 0.7.4's tuning saves it."""
    data: dict[str, object] = {"_metadata": metadata}
    for i in range(n):
        runner = f"Runner{i % 7}"
        shapes = ((1 << (i % 14), 4096 + i // 14), (4096 + i // 14, 7168))
        key = str((OPS[i % len(OPS)], runner, shapes, ("torch.bfloat16", i % 3)))
        data[key] = [runner, [i % 11, [i % 5, 2]], POLICY]
        if selections:
            time_ms = round(0.004 + i * 1.7e-6, 6)
            runner_up = round(time_ms * 1.0731, 6)
            selection = {
                "time_ms": time_ms,
                "runner_up_ms": runner_up,
                "margin": round(runner_up / time_ms - 1.0, 6),
                "candidates": 3 + i % 9,
            }
            data[key].append(selection)
    return json.dumps(data, indent=2)


@contextlib.contextmanager
def collector_off() -> Iterator[None]:
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def timed(fn: Callable[[], T]) -> tuple[float, T]:
    """``fn()``'s wall time in ms, and its result."""
    t0 = time.perf_counter()
    result = fn()
    return (time.perf_counter() - t0) * 1000, result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--entries", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=9)
    parser.add_argument(
        "--selections", action="store_true", help="values with FlashInfer 0.7.4's fourth element"
    )
    args = parser.parse_args(argv)
    logger.setLevel(logging.WARNING)  # load_configs logs each load at INFO
    tuner = AutoTuner.get()
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        path = tmp / "cache.json"
        path.write_text(cache_file(args.entries, dict(_collect_metadata()), args.selections))
        gc.collect()

        def load_configs() -> None:
            if not tuner.load_configs(str(path)):
                raise SystemExit("load_configs refused the file; the comparison would be wrong")

        times: dict[str, list[float]] = {
            "json": [],
            "load": [],
            "load_gc": [],
            "parse": [],
            "write": [],
        }
        for rep in range(args.reps):
            with collector_off():
                times["json"].append(timed(lambda: json.loads(path.read_bytes()))[0])
                tuner.clear_cache()
                times["load"].append(timed(load_configs)[0])
            tuner.clear_cache()
            times["load_gc"].append(timed(load_configs)[0])
            tuner.clear_cache()
            parse_ms, parsed = timed(lambda: read_cache_file(path))
            times["parse"].append(parse_ms)
            with Registry.open(str(tmp / f"registry-{rep}.db")) as reg:  # opened, not timed
                files = [(str(path), parsed)]
                times["write"].append(timed(lambda: reg.import_cache(files))[0])  # noqa: B023
    med = {name: statistics.median(values) for name, values in times.items()}
    total = med["parse"] + med["write"]
    shape = " with selections" if args.selections else ""
    print(f"import of {args.entries} entries{shape}, medians of {args.reps} rounds:")
    print(f"  ficache parse       {med['parse']:8.1f} ms")
    print(f"  ficache write       {med['write']:8.1f} ms")
    print(f"  parse + write       {total:8.1f} ms")
    print(
        f"  FlashInfer load_configs {med['load']:6.1f} ms (collector on: {med['load_gc']:.1f} ms)"
    )
    print(f"  json.load           {med['json']:8.1f} ms")
    print(
        f"  ratio (parse + write) / load_configs: {total / med['load']:.1f}x (target <= 5x); "
        f"/ json.load: {total / med['json']:.1f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
