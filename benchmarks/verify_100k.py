"""How long ``ficache verify`` takes on a large registry.

    python benchmarks/verify_100k.py                  # 100k entries, SQLite
    python benchmarks/verify_100k.py --entries 1000000
    python benchmarks/verify_100k.py --db postgresql+psycopg://...   # an empty database

Builds a registry of ``--entries`` entries under two fingerprints, shared and
rank-scoped, through the library's own writes: one import of all of them, a
merge replacing half, a startup commit adding and removing a few, a prune
and a revert, so the change log holds about twice as many rows as there are
entries. Then it times ``ficache.verify.verify`` (best of ``--repeat``) and
SQLite's ``PRAGMA integrity_check`` alone. Nothing here asserts: it prints.
Not run in CI.
"""

from __future__ import annotations

import argparse
import sqlite3
import tempfile
import time
from pathlib import Path

from ficache.fingerprint import Fingerprint
from ficache.registry import NewEntry, Registry
from ficache.verify import verify

FIELDS = {
    "flashinfer_version": "0.7.2.post1",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "91002",
    "cudnn_frontend_version": "1.32.0",
    "cutlass_dsl_version": "4.8.1",
}
H200 = Fingerprint(**FIELDS, gpu="NVIDIA H200")
B200 = Fingerprint(**FIELDS, gpu="NVIDIA B200")
POLICY = '["cuda_graph_profile_replays",null,"l2_cache_policy","hot"]'
OPS = ("flashinfer::mm_bf16", "flashinfer::trtllm_fp8_block_scale_moe", "flashinfer::cudnn_gemm")


def _entry(i: int, tactic: int) -> NewEntry:
    runner = f"Runner{i % 7}"
    key = str(
        (
            OPS[i % 3],
            runner,
            ((1 << (i % 14), 4096 + i // 14), (4096, 7168)),
            ("torch.bfloat16", i % 3),
        )
    )
    fp = H200 if i % 2 else B200
    scope = "shared" if i % 5 else f"tp4/rank{i % 4}"
    return NewEntry(fp, key, runner, f"[{tactic},[{i % 5},2]]", POLICY if i % 3 else None, scope)


def build(db: str, entries: int) -> None:
    with Registry.open(db) as reg:
        reg.write([_entry(i, i % 11) for i in range(entries)], kind="import")
        reg.write([_entry(i, 100 + i % 11) for i in range(0, entries, 2)], kind="merge")
        extra = [_entry(entries + i, 1) for i in range(100)]
        gone = [_entry(i, 0) for i in range(1, 200, 2)]
        startup = reg.write(
            extra,
            kind="startup",
            removals=[(e.fingerprint, e.scope, e.key) for e in gone],
        )
        assert startup.commit_id is not None
        reg.revert(startup.commit_id)
        reg.plan_prune(scope="tp4/rank3").execute(reg)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--entries", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--db", help="an empty database URL (default: a temporary SQLite file)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        db = args.db or str(Path(tmp) / "registry.db")
        started = time.perf_counter()
        build(db, args.entries)
        print(f"built in {time.perf_counter() - started:.1f} s")
        best = float("inf")
        for _ in range(args.repeat):
            started = time.perf_counter()
            report = verify(db)
            best = min(best, time.perf_counter() - started)
        checked = report.checked
        assert checked is not None
        print(
            f"verify: {best:.2f} s (best of {args.repeat}), ok={report.ok}, "
            f"{checked.entries} entries, {checked.changes} changes, {checked.commits} commits"
        )
        if args.db is None:
            conn = sqlite3.connect(f"file:{db}?mode=ro", uri=True)
            started = time.perf_counter()
            conn.execute("PRAGMA integrity_check").fetchall()
            print(f"of which PRAGMA integrity_check alone: {time.perf_counter() - started:.2f} s")
            conn.close()
            print(f"file size: {Path(db).stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
