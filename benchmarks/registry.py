"""Registry benchmark: import, export and list at several sizes, side by side
with the peer the registry replaces (one FlashInfer JSON cache file).

    python benchmarks/registry.py                 # 1k, 10k, 100k; 1M-entry export
    python benchmarks/registry.py --sizes 1000 --big 0 --reps 3

Figures are medians over ``--reps`` runs. Targets (2-core machine): export of
one fingerprint's 10k entries from a 1M-entry registry under 100 ms; a commit
of 10k entries under 500 ms. Nothing here asserts: it prints.
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

from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import canonical_json, parse_cache_bytes, render_cache
from ficache.registry import NewEntry, Registry

POLICY = ["cuda_graph_profile_replays", None, "l2_cache_policy", "hot"]


def fingerprint(i: int) -> Fingerprint:
    return Fingerprint(
        flashinfer_version="0.7.2.post1",
        cuda_version="13.0",
        cublas_version="13.1.0",
        cudnn_version="91300",
        cudnn_frontend_version="1.32.0",
        cutlass_dsl_version="4.8.1",
        gpu=f"NVIDIA H200 #{i}",
        compute_capability="9.0",
        torch_version="2.13.0",
    )


def synthetic_file(n: int, seed: int = 0) -> dict[str, object]:
    """A FlashInfer-shaped cache with ``n`` entries (keys as FlashInfer writes them)."""
    data: dict[str, object] = {"_metadata": fingerprint(0).flashinfer_metadata()}
    ops = (
        "flashinfer::mm_bf16",
        "flashinfer::trtllm_fp8_block_scale_moe",
        "flashinfer::cudnn_gemm",
    )
    for i in range(n):
        op = ops[i % len(ops)]
        runner = f"Runner{i % 7}"
        shapes = ((1 << (i % 14), 4096 + i // 14), (4096 + i // 14, 7168))
        key = str((op, runner, shapes, ("torch.bfloat16", i % 3)))
        data[key] = [runner, [(i + seed) % 11, [i % 5, 2]], POLICY]
    return data


def median_ms(
    fn: Callable[[], object], reps: int, setup: Callable[[], object] | None = None
) -> float:
    times = []
    for _ in range(reps):
        if setup is not None:
            setup()
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def row(label: str, ours: float, peer: float | None) -> str:
    ratio = f"{ours / peer:6.2f}x" if peer else "     -"
    peer_s = f"{peer:9.1f}" if peer is not None else "        -"
    return f"{label:<34}{ours:10.1f}{peer_s}   {ratio}"


def bench_size(n: int, reps: int, tmp: Path) -> None:
    data = synthetic_file(n)
    blob = json.dumps(data, indent=2).encode()
    src = tmp / f"cache-{n}.json"
    src.write_bytes(blob)
    db = tmp / f"reg-{n}.db"

    def fresh() -> None:
        for suffix in ("", "-wal", "-shm"):
            Path(str(db) + suffix).unlink(missing_ok=True)
        Registry.open(str(db)).close()

    def do_import() -> None:
        with Registry.open(str(db)) as reg:
            reg.import_cache([(str(src), parse_cache_bytes(src.read_bytes()))])

    # The peer of an import into the registry: FlashInfer merging a file into
    # its cache file (read both, merge, write the JSON back).
    peer_path = tmp / f"peer-{n}.json"

    def peer_import() -> None:
        merged = json.loads(src.read_bytes())
        if peer_path.exists():
            old = json.loads(peer_path.read_bytes())
            old.update(merged)
            merged = old
        peer_path.write_text(json.dumps(merged, indent=2))

    t_import = median_ms(do_import, reps, setup=fresh)
    t_peer_import = median_ms(peer_import, reps, setup=lambda: peer_path.unlink(missing_ok=True))

    fresh()
    do_import()
    with Registry.open(str(db)) as reg:
        t_export = median_ms(lambda: reg.export_text(1), reps)
        t_list = median_ms(lambda: sum(1 for _ in reg.entries()), reps)
    t_peer_export = median_ms(lambda: json.dumps(json.loads(src.read_bytes()), indent=2), reps)

    entries = [
        NewEntry(fingerprint(1), key, value[0], canonical_json(value[1]), canonical_json(value[2]))  # type: ignore[index]
        for key, value in data.items()
        if key != "_metadata"
    ]

    # A commit of n new entries: one write transaction on an open registry
    # (the startup protocol's commit; opening is measured by import above).
    opened: list[Registry] = []

    def open_fresh() -> None:
        for reg in opened:
            reg.close()
        opened.clear()
        fresh()
        opened.append(Registry.open(str(db)))

    t_commit = median_ms(lambda: opened[0].write(entries, kind="import"), reps, setup=open_fresh)
    for reg in opened:
        reg.close()
    print(row(f"import {n:>7} entries (file->db)", t_import, t_peer_import))
    print(row(f"commit {n:>7} entries", t_commit, None))
    print(row(f"export {n:>7} entries (db->file)", t_export, t_peer_export))
    print(row(f"list   {n:>7} entries", t_list, None))


def bench_big(total: int, per_fp: int, reps: int, tmp: Path) -> None:
    db = tmp / "big.db"
    n_fp = max(total // per_fp, 1)
    data = synthetic_file(per_fp)
    items = [(k, v) for k, v in data.items() if k != "_metadata"]
    t0 = time.perf_counter()
    with Registry.open(str(db)) as reg:
        for f in range(n_fp):
            reg.write(
                (
                    NewEntry(fingerprint(f), k, v[0], canonical_json(v[1]), canonical_json(v[2]))  # type: ignore[index]
                    for k, v in items
                ),
                kind="import",
            )
    build_s = time.perf_counter() - t0
    with Registry.open(str(db)) as reg:
        middle = n_fp // 2 + 1
        t_export = median_ms(lambda: reg.export_text(middle), reps)
        text, count = reg.export_text(middle)
    peer = tmp / "big-peer.json"
    peer.write_text(text)
    t_peer = median_ms(lambda: render_cache(*_peer_rows(peer)), reps)
    print(
        f"(built {n_fp} fingerprints x {per_fp} entries = {n_fp * per_fp} entries in {build_s:.0f} s)"
    )
    print(row(f"export {count} of {n_fp * per_fp} entries", t_export, t_peer))


def _peer_rows(path: Path) -> tuple[dict[str, str], list[tuple[str, str, str, str | None]]]:
    """The peer of a registry export: read one file, render it back."""
    data = json.loads(path.read_bytes())
    meta = data.pop("_metadata")
    return meta, [
        (k, v[0], json.dumps(v[1]), json.dumps(v[2]) if len(v) > 2 else None)
        for k, v in data.items()
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sizes", type=int, nargs="*", default=[1_000, 10_000, 100_000])
    parser.add_argument(
        "--big", type=int, default=1_000_000, help="entries in the big registry (0 skips)"
    )
    parser.add_argument("--per-fingerprint", type=int, default=10_000)
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args(argv)
    print(f"{'operation':<34}{'ficache ms':>10}{'peer ms':>9}   ratio")
    print(
        "peer: one FlashInfer JSON cache file (merge-and-rewrite for import, read-and-write for export)"
    )
    with tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        for n in args.sizes:
            bench_size(n, args.reps, tmp)
        if args.big:
            bench_big(args.big, args.per_fingerprint, args.reps, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
