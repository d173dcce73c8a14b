"""GPU proof that FlashInfer's ``autotune_v2`` serves a store ficache exported.

On one CUDA GPU, each step in a process of its own (fresh ``AutoTuner``):

1. ``tune``: ``autotune_v2(mode="tune", cache_root=A)`` around the bundled
   tunable op's warmup (``ficache.tunable_matmul``, 52 entries): FlashInfer
   profiles every entry and publishes it into store ``A``. Then the tactic
   ``choose_one`` returns for every ``(K, N, M bucket)`` is recorded.
2. ``ficache import A`` into a fresh SQLite registry, then ``ficache export
   --v2-store B --fingerprint current`` (the CLI, as an operator runs it),
   and the same export again into ``B2``.
3. ``serve``: a new process, ``autotune_v2(mode="tune", cache_root=B)``: every
   ``choose_one`` is answered from ``B`` (tuning is on, so any miss would be
   profiled: profiled must be 0) and returns the tactic step 1 tuned.
4. ``replay``: a new process, ``autotune_v2(mode="replay", cache_root=B)``:
   profiled 0, the same tactics (a miss would return the fallback, -1,
   which differs from every entry tuned to another tactic).

Also compares the stores: ``B`` has the same environment directory and
entry files as ``A``, byte for byte, and ``B2`` equals ``B``. Prints JSON.
Needs a CUDA GPU; on a machine without a package index ``source
.gpu/activate.sh`` first (see the project notes on running on GPUs).

    python benchmarks/gpu_v2_proof.py
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

CHILD_TIMEOUT = 600


def _choices() -> dict[str, int]:
    """The tactic ``choose_one`` returns for every weight shape and M bucket."""
    import torch
    from flashinfer.autotuner import AutoTuner

    from ficache.tunable_matmul import BUCKETS, CONFIG, DEFAULT_WEIGHTS, OP, RUNNER

    tuner = AutoTuner.get()
    out: dict[str, int] = {}
    with torch.inference_mode():
        for k, n in DEFAULT_WEIGHTS:
            b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
            for m in BUCKETS:
                a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
                _, tactic = tuner.choose_one(OP, [RUNNER], CONFIG, [a, b])
                out[f"{k}x{n}/m={m}"] = int(tactic)
    torch.cuda.synchronize()
    return out


def child(step: str, root: Path) -> dict[str, Any]:
    import logging

    from flashinfer.autotune_cache import autotune_v2
    from flashinfer.autotuner import AutoTuner

    from ficache.tunable_matmul import OP, warmup

    logging.getLogger("flashinfer").setLevel(logging.WARNING)
    tuner = AutoTuner.get()
    tuner.reset_statistics()
    started = time.perf_counter()
    if step == "tune":
        with autotune_v2(mode="tune", cache_root=root / "A"):
            warmup()  # nests autotune(True): profiles and publishes every entry
            choices = _choices()
    else:
        mode = "tune" if step == "serve" else "replay"
        with autotune_v2(mode=mode, cache_root=root / "B"):
            choices = _choices()
    return {
        "step": step,
        "seconds": round(time.perf_counter() - started, 3),
        "profiled": tuner.stats.tuned_op_successful_configs.get(OP, 0),
        "choices": choices,
    }


def _run_child(step: str, root: Path) -> dict[str, Any]:
    out = root / f"{step}.json"
    subprocess.run(
        [sys.executable, __file__, "--child", step, "--root", str(root), "--out", str(out)],
        check=True,
        timeout=CHILD_TIMEOUT,
    )
    return json.loads(out.read_text())


def _ficache(root: Path, *args: str) -> str:
    done = subprocess.run(
        [sys.executable, "-m", "ficache", "--db", str(root / "registry.db"), *args],
        check=True,
        timeout=CHILD_TIMEOUT,
        capture_output=True,
        text=True,
    )
    return done.stdout


def _store_files(store: Path) -> dict[str, str]:
    """Every file of a store, relative path -> sha256 of its bytes."""
    return {
        str(p.relative_to(store)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(store.rglob("*"))
        if p.is_file() and not p.name.startswith(".")
    }


def run() -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="ficache-gpu-v2-") as tmp:
        root = Path(tmp)
        os.environ["XDG_CACHE_HOME"] = str(root / "user-cache")
        tuned = _run_child("tune", root)
        imported = _ficache(root, "import", str(root / "A"))
        exported = _ficache(
            root, "export", "--v2-store", str(root / "B"), "--fingerprint", "current"
        )
        _ficache(root, "export", "--v2-store", str(root / "B2"), "--fingerprint", "current")
        served = _run_child("serve", root)
        replayed = _run_child("replay", root)
        a, b, b2 = (_store_files(root / name) for name in ("A", "B", "B2"))
    entry_files = [p for p in a if "/entries/" in p]
    return {
        "entries_tuned": len(tuned["choices"]),
        "tune": {k: tuned[k] for k in ("seconds", "profiled")},
        "serve": {k: served[k] for k in ("seconds", "profiled")},
        "replay": {k: replayed[k] for k in ("seconds", "profiled")},
        "serve_tactics_equal_tuned": served["choices"] == tuned["choices"],
        "replay_tactics_equal_tuned": replayed["choices"] == tuned["choices"],
        "tactics_tuned": sorted(set(tuned["choices"].values())),
        "entries_tuned_to_a_non_fallback_tactic": sum(t != -1 for t in tuned["choices"].values()),
        "store_A_entry_files": len(entry_files),
        "export_equals_flashinfer_store_byte_for_byte": a == b,
        "files_differing_from_A": sorted(set(a.items()) ^ set(b.items())),
        "export_twice_identical": b == b2,
        "import_output": imported.strip().splitlines(),
        "export_output": exported.strip().splitlines(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--child", choices=("tune", "serve", "replay"))
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
