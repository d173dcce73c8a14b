"""GPU proof of a v2-mode warm start (``ficache.v2_mode``) through FlashInfer's real ``autotune_v2``.

On one CUDA GPU, each step in a process of its own (a fresh ``AutoTuner``, as a
restarted server), on one SQLite registry:

1. ``cold``: ``ficache.warm_start`` (defaults) around ``autotune_v2(mode="tune",
   cache_root=<a node-local root>)`` and the bundled tunable op's warmup
   (``ficache.tunable_matmul``, 52 entries), then ``autotune_v2_reload()`` as
   vLLM's warmup finalizes: FlashInfer profiles every entry into the store
   ficache attached (the root the block named is redirected), and ficache
   commits what it published there. Then the tactic ``choose_one`` returns for
   every ``(K, N, M bucket)`` is recorded. Where FlashInfer has protocol
   records (0.7.4), the block also runs ``ficache.standin_protocol`` (a
   stand-in for a MegaMoE protocol, measuring nothing) through FlashInfer's
   ``choose_with_protocol``: it publishes 3 protocol records into the store,
   which ficache commits too.
2. ``warm``: the same block in a new process: the registry's slice is served as
   the store, so FlashInfer profiles 0 (tuning is on: a miss would be
   profiled), the protocol finds every record, ficache commits nothing, and
   every tactic equals step 1's.

Also checks that nothing was published under the node-local root the block
named. Prints JSON. Needs a CUDA GPU; on a machine without a package index
``source .gpu/activate.sh`` first (see the project notes on running on GPUs).

    python benchmarks/gpu_v2_mode.py
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD_TIMEOUT = 600


def child(step: str, root: Path) -> dict[str, Any]:
    import logging

    from flashinfer import autotune_v2, autotune_v2_reload
    from flashinfer.autotuner import AutoTuner
    from gpu_v2_proof import _choices

    import ficache
    from ficache.standin_protocol import StandInProtocol, run_standin_protocol
    from ficache.tunable_matmul import OP, warmup

    logging.getLogger("flashinfer").setLevel(logging.WARNING)
    tuner = AutoTuner.get()
    tuner.reset_statistics()
    started = time.perf_counter()
    protocol: StandInProtocol | None = None
    with ficache.warm_start(None, db=root / "registry.db") as ws:
        with autotune_v2(mode="tune", cache_root=root / "node-local"):
            warmup()  # nests autotune(True): profiles what the store does not hold
            if hasattr(tuner, "choose_with_protocol"):
                protocol = run_standin_protocol(0)
        autotune_v2_reload()
    seconds = time.perf_counter() - started
    choices = _choices()
    report = ws.report
    return {
        "step": step,
        "seconds": round(seconds, 3),
        "profiled": tuner.stats.tuned_op_successful_configs.get(OP, 0),
        "choices": choices,
        "report": {
            k: getattr(report, k)
            for k in (
                "status",
                "reason",
                "loaded",
                "tuned",
                "committed",
                "commit_id",
                "protocol_loaded",
                "protocol_tuned",
                "protocol_committed",
                "v2",
            )
        }
        | {"seconds": report.seconds},
        "protocol": None
        if protocol is None
        else {"hits": protocol.hits, "published": protocol.published},
    }


def _run_child(step: str, root: Path) -> dict[str, Any]:
    out = root / f"{step}.json"
    subprocess.run(
        [sys.executable, __file__, "--child", step, "--root", str(root), "--out", str(out)],
        check=True,
        timeout=CHILD_TIMEOUT,
    )
    return json.loads(out.read_text())


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ficache-gpu-v2-mode-") as tmp:
        root = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(root / "user-cache")
        cold = _run_child("cold", root)
        warm = _run_child("warm", root)
        node_local = sorted(str(p) for p in (root / "node-local").rglob("*.json"))
    return {
        "entries": len(cold["choices"]),
        "cold": {k: cold[k] for k in ("seconds", "profiled", "report", "protocol")},
        "warm": {k: warm[k] for k in ("seconds", "profiled", "report", "protocol")},
        "warm_profiled_0": warm["profiled"] == 0,
        "cold_committed_every_profiled_entry": cold["report"]["committed"] == cold["profiled"],
        "warm_tactics_equal_cold": warm["choices"] == cold["choices"],
        "files_published_under_the_node_local_root": node_local,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", choices=("cold", "warm"))
    parser.add_argument("--root", type=Path)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    if args.child:
        args.out.write_text(json.dumps(child(args.child, args.root)))
        return 0
    print(json.dumps(run(), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
