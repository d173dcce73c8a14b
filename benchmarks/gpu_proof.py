"""GPU proof of the startup protocol: real FlashInfer tuning on 2 GPUs (one rank each).

Runs, on the bundled tunable op (``ficache.tunable_matmul``, 52 entries):

1. independent tuning (``synchronize=False``) on a fresh registry: how many
   entries' tactics differ between the ranks;
2. a synchronized cold start on another fresh registry: commits every entry,
   0 disagreements;
3. a second start: loads every entry, profiles nothing, commits nothing;
4. half the entries deleted from the registry, then two replay starts
   (``mode="replay"``) asking for every bucket of every weight under
   ``autotune(True)``: each profiles nothing, reports exactly the deleted half
   as missed (FlashInfer's fallback tactic), commits nothing, and both boots
   and both ranks pick the same tactic for every key;
5. then a start in the default mode: tunes exactly the missing half,
   synchronized, and commits it.

Prints the figures as JSON (rank 0's view plus per-rank counts). Needs two
CUDA GPUs; on a machine without a package index, ``source .gpu/activate.sh``
first (see the project notes on running on GPUs).

    python benchmarks/gpu_proof.py [--world 2]
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import sys
import tempfile
import time
from pathlib import Path
from typing import Any


def _start(db: Path, **kwargs: Any) -> dict[str, Any]:
    from flashinfer.autotuner import AutoTuner

    from ficache.sync import warm_start
    from ficache.tunable_matmul import OP, warmup
    from ficache.tuner import FlashInferTuner, row_value

    tuner = AutoTuner.get()
    started = time.perf_counter()
    with warm_start(None, db=str(db), timeout=600, **kwargs) as ws:
        tuner.reset_statistics()
        block = time.perf_counter()
        entries = warmup()
        block = time.perf_counter() - block
        profiled = tuner.stats.tuned_op_successful_configs.get(OP, 0)
        profiled_keys = sorted(FlashInferTuner().tuned())
    return {
        "seconds": time.perf_counter() - started,  # the whole start, block included
        "block_seconds": block,
        "entries": entries,
        "profiled": profiled,
        "profiled_keys": profiled_keys,
        "report": ws.report.as_json(),
        # The values ranks must agree on (FlashInfer 0.7.4's selection is each rank's timing).
        "held": {k: row_value(v) for k, v in FlashInferTuner().entries().items()},
    }


def _serve_every_bucket() -> dict[str, Any]:
    """Ask FlashInfer for every bucket of every default weight, as a server's warmup would
    (``autotune(True)``), running each chosen kernel; ``file_key -> tactic`` chosen."""
    import torch
    from flashinfer.autotuner import AutoTuner, autotune

    from ficache.tunable_matmul import BUCKETS, CONFIG, DEFAULT_WEIGHTS, OP, RUNNER

    tuner = AutoTuner.get()
    device = torch.device("cuda", torch.cuda.current_device())
    chosen: dict[str, Any] = {}
    with torch.inference_mode(), autotune(True):
        for k, n in DEFAULT_WEIGHTS:
            b = torch.randn(k, n, device=device, dtype=torch.bfloat16)
            for m in BUCKETS:
                a = torch.randn(m, k, device=device, dtype=torch.bfloat16)
                runner, tactic = tuner.choose_one(OP, [RUNNER], CONFIG, [a, b])
                runner([a, b], tactic=tactic)
                key = tuner._get_cache_key(
                    OP, RUNNER, ((m, k), (k, n)), CONFIG, RUNNER.get_cache_key_extras([a, b])
                )
                chosen[key.file_key] = tactic
    torch.cuda.synchronize(device)
    return chosen


def _replay(db: Path) -> dict[str, Any]:
    """One replay start (``mode="replay"``) whose block serves every bucket."""
    from flashinfer.autotuner import AutoTuner

    from ficache.sync import warm_start
    from ficache.tunable_matmul import OP

    tuner = AutoTuner.get()
    started = time.perf_counter()
    with warm_start(None, db=str(db), timeout=600, mode="replay") as ws:
        tuner.reset_statistics()
        block = time.perf_counter()
        chosen = _serve_every_bucket()
        block = time.perf_counter() - block
        profiled = tuner.stats.tuned_op_successful_configs.get(OP, 0)
    return {
        "seconds": time.perf_counter() - started,
        "block_seconds": block,
        "profiled": profiled,
        "chosen": chosen,
        "report": ws.report.as_json(),
    }


def proof_rank(rank: int, world: int, root: str) -> dict[str, Any]:
    import logging

    import torch
    import torch.distributed as dist

    logging.getLogger("flashinfer").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)
    os.environ["XDG_CACHE_HOME"] = str(Path(root) / "user-cache")
    device = rank % torch.cuda.device_count()  # one GPU: the ranks share it (gloo group)
    torch.cuda.set_device(device)
    out: dict[str, Any] = {"rank": rank, "gpu": torch.cuda.get_device_name(device)}

    # (The first start also pays FlashInfer's one-time JIT build of its timing kernel.)
    out["independent"] = _start(Path(root) / "independent.db", synchronize=False)

    db = Path(root) / "registry.db"
    out["cold"] = _start(db)
    out["warm"] = _start(db)
    deleted: list[str] = []
    if rank == 0:
        conn = sqlite3.connect(db)
        deleted = [
            k for (k,) in conn.execute("SELECT key FROM entries WHERE id % 2 = 0 ORDER BY key")
        ]
        conn.execute("DELETE FROM entries WHERE id % 2 = 0")
        conn.commit()
        conn.close()
    dist.barrier()
    out["deleted"] = deleted
    out["replay1"] = _replay(db)
    out["replay2"] = _replay(db)
    out["half"] = _start(db)
    return out


def summarize(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    zero = per_rank[0]

    def start(name: str) -> dict[str, Any]:
        r = zero[name]["report"]
        return {
            "status": r["status"],
            "loaded": r["loaded"],
            "tuned": r["tuned"],
            "committed": r["committed"],
            "commit_id": r["commit_id"],
            "shared": r["shared"],
            "scoped": r["scoped"],
            "disagreements": r["disagreements"],
            "synchronized": r["synchronized"],
            "reason": r["reason"],
            "profiled_by_rank": [p[name]["profiled"] for p in per_rank],
            "loaded_by_rank": r["loaded_by_rank"],
            "tuned_by_rank": r["tuned_by_rank"],
            "seconds_by_rank": [round(p[name]["seconds"], 3) for p in per_rank],
            "block_seconds_by_rank": [round(p[name]["block_seconds"], 3) for p in per_rank],
            "protocol_seconds": {k: round(v, 4) for k, v in r["seconds"].items()},
        }

    independent = [p["independent"]["held"] for p in per_rank]
    differing = sum(
        1 for k in independent[0] if any(h.get(k) != independent[0][k] for h in independent[1:])
    )
    return {
        "world": len(per_rank),
        "gpus": [p["gpu"] for p in per_rank],
        "entries": zero["cold"]["entries"],
        "independent": {**start("independent"), "entries_differing_between_ranks": differing},
        "cold": start("cold"),
        "warm": start("warm"),
        "half": {
            **start("half"),
            "deleted": len(zero["deleted"]),
            "profiled_exactly_the_deleted_keys": all(
                p["half"]["profiled_keys"] == zero["deleted"] for p in per_rank
            ),
        },
        "replay": _replay_summary(per_rank),
        "final_caches_identical_on_every_rank": all(
            p["half"]["held"] == zero["half"]["held"] for p in per_rank
        ),
    }


def _replay_summary(per_rank: list[dict[str, Any]]) -> dict[str, Any]:
    """The two replay boots (step 4): what they missed, profiled and picked, on every rank."""
    zero = per_rank[0]
    boots = [p[name] for p in per_rank for name in ("replay1", "replay2")]
    fell_back = [sorted(k for k, t in b["chosen"].items() if t == -1) for b in boots]
    return {
        "status": zero["replay1"]["report"]["status"],
        "loaded": zero["replay1"]["report"]["loaded"],
        "missed_by_rank_and_boot": [b["report"]["missed"] for b in boots],
        "profiled_by_rank_and_boot": [b["profiled"] for b in boots],
        "committed": [b["report"]["committed"] for b in boots],
        "reason": zero["replay1"]["report"]["reason"],
        "fell_back_on_exactly_the_deleted_keys": all(
            f == sorted(zero["deleted"]) for f in fell_back
        ),
        "identical_tactics_on_every_boot_and_rank": all(
            b["chosen"] == boots[0]["chosen"] for b in boots
        ),
        "keys_asked": len(zero["replay1"]["chosen"]),
        "seconds_by_rank_and_boot": [round(b["seconds"], 3) for b in boots],
        "block_seconds_by_rank_and_boot": [round(b["block_seconds"], 3) for b in boots],
    }


def run(world: int = 2) -> dict[str, Any]:
    from ficache._ranks import run_ranks

    sys.path.insert(0, str(Path(__file__).resolve().parent))  # so the ranks import this module
    import gpu_proof

    with tempfile.TemporaryDirectory(prefix="ficache-gpu-proof-") as root:
        per_rank = run_ranks(gpu_proof.proof_rank, world, root, timeout=900, group_timeout=600)
    return summarize(per_rank)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--world", type=int, default=2)
    args = parser.parse_args(argv)
    print(json.dumps(run(args.world), indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
