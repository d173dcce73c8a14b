"""The soak's load generator: worker processes drawing registry operations at random.

``run(CONFIG_PATH)`` is what ``tests/test_soak.py`` runs in a forked child of
the forker (``tests/forker.py``, op ``call``). It reads the JSON config the
test wrote (``db``, ``workers``, ``seed``, ``out``, ``start_at``, ``end_at``),
forks ``workers`` processes, waits for them and returns 0 when every one ran
to its end (1 otherwise). Each worker waits for the shared ``start_at``, then
draws operations by ``WEIGHTS`` from its own seeded RNG
(``random.Random(f"{seed}/{index}")``) until ``end_at``:

- ``import``: a FlashInfer cache file of one fingerprint of the fleet
  (``FLEET``: H200 and B200 with the metadata ``META``), keys drawn from a
  pool of ``OPS * MS`` keys, into one scope of ``FLEET_SCOPES``;
- ``merge``: one to three such files (and at times the worker's latest
  bundle) under a policy drawn from keep/theirs/newest/vote/drop;
- ``prune``: the entries of one rank scope of the fleet (of one fingerprint
  or all), or the warm starts' entries last written more than a few seconds
  ago;
- ``warm_start``: ``ficache.warm_start`` on one process (world 1) with the
  CPU stand-in (``ficache.standin``) tuning a few ``WARM_SHAPES`` (6 keys
  each) with a tactic drawn at random, so workers commit different values
  for the same keys and the first committed wins;
- ``export``: a fleet fingerprint's scope rendered, written and read back;
- ``bundle``: a bundle of the fleet (and at times the warm starts'
  fingerprint) written, read back and imported;
- ``verify``: ``ficache.verify`` while the others write;
- ``import_own``, ``prune_own``, ``revert_own``: imports into, prunes of
  one scope of, and reverts of the latest commit to, a fingerprint only this
  worker writes (``own_metadata``), whose expected content the worker keeps
  in its own serial model (key -> value).

Invariants (what ``tests/test_soak.py`` relies on):
- Every operation is one JSON line in ``worker-<index>.jsonl`` (flushed
  before the next operation starts): ``op`` (a key of ``WEIGHTS``),
  ``worker``, ``started`` (wall clock), ``op_s`` (the whole operation,
  opening the registry included), ``commit_s`` (the time spent in the
  registry's write transactions: from asking for the write lock to the
  commit, retries included, measured by ``_CommitTimer`` around
  ``ficache.schema.write_transaction``), ``retries`` (stale plans re-made),
  ``outcome`` (``committed``, ``unchanged``, ``ok`` for a read, ``conflict``,
  ``error`` with ``error``) and, when a commit was made, ``commit`` and
  ``counts`` ([added, replaced, removed] as the registry reported them).
  Writers also log what they asked for: ``writes`` ([digest, scope, key,
  runner, tactic, policy] of every entry asked to be stored; values are the
  first three fields of a row, ``ficache.tuner.row_value``, never its
  selection), ``removals`` ([digest, scope, key], merges), ``keep_existing``
  (warm starts), ``planned`` (the entries a prune's plan removes).
- A line with ``commit`` is written only for a commit the registry returned;
  every commit a worker made has its line (a worker that dies mid-run fails
  the test through its parent's exit code and its missing model).
- A stale merge or prune plan (``ConflictError``: a concurrent commit changed
  its entries, so nothing was written) is re-planned up to
  ``PLAN_ATTEMPTS`` times and counted in ``retries``; when every attempt is
  stale the outcome is ``conflict``, never ``error``. Anything else raised is
  an ``error``.
- Only worker ``index`` writes its own fingerprint (gpu ``Soak worker
  <index>``): fleet imports, merges, prunes and bundles touch only the
  fleet's and the warm starts' fingerprints (merge sources and bundles are
  made of those, and prunes name fingerprints or the fleet's rank scopes).
  Its model is updated only from commits the registry returned, and written
  as ``worker-<index>-model.json`` (``digest``, ``entries``: [scope, key,
  runner, tactic, policy]) when the worker ends.
- Workers die with their parent (``PR_SET_PDEATHSIG``), so the test's hard
  deadline on the parent bounds them too.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import random
import signal
import sys
import time
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from samples import SHORT_H200_METADATA

from ficache import schema
from ficache.errors import ConflictError, NotFoundError
from ficache.fingerprint import Fingerprint
from ficache.flashinfer_format import parse_cache_bytes
from ficache.registry import SHARED_SCOPE, NewEntry, Registry, WriteResult, rank_scope

#: The fleet's FlashInfer metadata, less the GPU (``FLEET`` adds it).
META = {k: v for k, v in SHORT_H200_METADATA.items() if k != "gpu"}
#: The fleet's fingerprints, by name: what imports, merges, prunes and bundles touch.
FLEET = {
    "H200": {**META, "gpu": "NVIDIA H200"},
    "B200": {**META, "gpu": "NVIDIA B200"},
}
FLEET_SCOPES = (SHARED_SCOPE, "fleet/rank0", "fleet/rank1")
#: The key pool: ``OPS`` custom ops times ``MS`` profile buckets.
OPS = 6
MS = 8
#: ``(K, N)`` weight shapes the warm starts tune (6 stand-in buckets each).
WARM_SHAPES: tuple[tuple[int, int], ...] = ((32, 32), (32, 64), (64, 32), (64, 64))
#: How often a stale merge or prune plan is made again before the operation counts a conflict.
PLAN_ATTEMPTS = 5
#: Relative weights of the operations a worker draws.
WEIGHTS = {
    "import": 5,
    "merge": 3,
    "prune": 2,
    "warm_start": 2,
    "export": 2,
    "bundle": 1,
    "verify": 1,
    "import_own": 2,
    "prune_own": 1,
    "revert_own": 2,
}
#: The commit kind each writing operation makes.
COMMIT_KIND = {
    "import": "import",
    "merge": "merge",
    "prune": "prune",
    "warm_start": "startup",
    "bundle": "import",
    "import_own": "import",
    "prune_own": "prune",
    "revert_own": "revert",
}
MERGE_POLICIES = ("keep", "theirs", "newest", "vote", "drop")
RUNNER = "SoakRunner"

#: (digest, scope, key): one entry's identity.
Ident = tuple[str, str, str]
#: (runner, tactic JSON, policy JSON): one entry's value.
Value = tuple[str, str, str | None]


def key(op: int, m: int) -> str:
    """One key of the pool, as FlashInfer writes a ``file_key``."""
    return str((f"soak::op{op}", RUNNER, ((m, 256), (256, 512)), ("torch.bfloat16", op)))


def own_metadata(worker: int) -> dict[str, str]:
    """The metadata of the fingerprint only ``worker`` writes."""
    return {**META, "gpu": f"Soak worker {worker}"}


def _entry_json(e: NewEntry) -> list[Any]:
    return [e.fingerprint.digest, e.scope, e.key, e.runner, e.tactic_json, e.policy_json]


class _Stale(Exception):
    """Every attempt of a planned operation found its plan stale."""


class _CommitTimer:
    """Seconds spent in the registry's write transactions since ``seconds`` was reset.

    Wraps ``ficache.schema.write_transaction``, the one path of every write
    (``Registry.transaction`` looks it up on the module at each call), and only
    observes it: from asking for the lock to the commit (or the rollback).
    """

    def __init__(self) -> None:
        self.seconds = 0.0
        real = schema.write_transaction
        timer = self

        @contextlib.contextmanager
        def timed(engine: Any) -> Iterator[Any]:
            started = time.perf_counter()
            try:
                with real(engine) as conn:
                    yield conn
            finally:
                timer.seconds += time.perf_counter() - started

        schema.write_transaction = timed


class _StartResult:
    """What a warm start committed, in ``WriteResult``'s terms (a start only adds)."""

    def __init__(self, report: Any) -> None:
        self.commit_id: int | None = report.commit_id
        self.added: int = report.committed
        self.replaced = 0
        self.removed = 0


class Worker:
    """One load process: its RNG, its files, its own fingerprint and the model of it."""

    def __init__(self, config: dict[str, Any], index: int) -> None:
        from ficache.fingerprint import collect

        self.index = index
        self.db: str = config["db"]
        self.rng = random.Random(f"{config['seed']}/{index}")
        self.work = Path(config["out"]) / f"work-{index}"
        self.work.mkdir(parents=True, exist_ok=True)
        self.files = 0
        self.fleet = {
            name: Fingerprint.from_flashinfer_metadata(meta) for name, meta in FLEET.items()
        }
        self.own = Fingerprint.from_flashinfer_metadata(own_metadata(index))
        self.own_scope = rank_scope(f"own{index}", 0)
        self.current: Fingerprint = collect()  # the warm starts' fingerprint
        #: (scope, key) -> value: what the own fingerprint holds, by this worker's commits.
        self.model: dict[tuple[str, str], Value] = {}
        #: The latest commit to the own fingerprint and the model before it.
        self.last_own: tuple[int, dict[tuple[str, str], Value]] | None = None
        self.last_bundle: Path | None = None
        self.timer = _CommitTimer()

    # -- the loop -----------------------------------------------------------

    def run(self, start_at: float, end_at: float) -> int:
        time.sleep(max(0.0, start_at - time.time()))
        kinds = list(WEIGHTS)
        weights = [WEIGHTS[k] for k in kinds]
        log = Path(self.work.parent) / f"worker-{self.index}.jsonl"
        with log.open("a", encoding="utf-8") as handle:
            while time.time() < end_at:
                record = self.one(self.rng.choices(kinds, weights)[0])
                handle.write(json.dumps(record) + "\n")
                handle.flush()
        model = {
            "digest": self.own.digest,
            "entries": [[s, k, *v] for (s, k), v in sorted(self.model.items())],
        }
        target = self.work.parent / f"worker-{self.index}-model.json"
        tmp = target.with_suffix(".tmp")
        tmp.write_text(json.dumps(model))
        os.replace(tmp, target)
        return 0

    def one(self, kind: str) -> dict[str, Any]:
        """Run one operation of ``kind``; its log record."""
        record: dict[str, Any] = {
            "op": kind,
            "worker": self.index,
            "started": time.time(),
            "retries": 0,
        }
        self.timer.seconds = 0.0
        began = time.perf_counter()
        try:
            with Registry.open(self.db, create=False) as reg:
                getattr(self, f"op_{kind}")(reg, record)
        except _Stale:
            record["outcome"] = "conflict"
        except Exception as exc:  # noqa: BLE001 - every failure is logged, the load goes on
            record["outcome"] = "error"
            where = traceback.extract_tb(exc.__traceback__)[-3:]
            record["error"] = f"{type(exc).__name__}: {exc} at " + " < ".join(
                f"{Path(f.filename).name}:{f.lineno}" for f in reversed(where)
            )
        record["op_s"] = time.perf_counter() - began
        record["commit_s"] = self.timer.seconds
        return record

    # -- helpers ------------------------------------------------------------

    def _path(self, suffix: str) -> Path:
        self.files += 1
        return self.work / f"f{self.files}{suffix}"

    def _cache_file(self, metadata: dict[str, str], count: int) -> Path:
        """A FlashInfer cache file of ``count`` keys of the pool, values drawn at random.

        Some values carry a policy, and some of those a selection (FlashInfer
        0.7.4's fourth element), which is not part of the value.
        """
        rng = self.rng
        pool = [(op, m) for op in range(OPS) for m in range(1, MS + 1)]
        content: dict[str, Any] = {"_metadata": metadata}
        for op, m in rng.sample(pool, count):
            value: list[Any] = [RUNNER, [rng.randrange(3), m]]
            if rng.random() < 0.3:
                value.append(["median", rng.choice((3, 5))])
                if rng.random() < 0.5:
                    best = round(rng.uniform(0.01, 1.0), 4)
                    value.append({"time_ms": best, "runner_up_ms": round(best * 1.1, 4)})
            content[key(op, m)] = value
        path = self._path(".json")
        path.write_text(json.dumps(content))
        return path

    def _ids(self, reg: Registry) -> dict[str, int]:
        """Fingerprint ids in ``reg`` by digest."""
        return {info.fingerprint.digest: info.id for info in reg.fingerprints()}

    def _import(self, reg: Registry, path: Path, scope: str) -> tuple[list[NewEntry], WriteResult]:
        """Import one cache file into ``scope``: the entries it asked for, and the result."""
        cache = parse_cache_bytes(path.read_bytes(), source=str(path))
        assert cache.metadata is not None
        fp = Fingerprint.from_flashinfer_metadata(cache.metadata)
        entries = [
            NewEntry(fp, e.key, e.runner, e.tactic_json, e.policy_json, scope)
            for e in cache.entries
        ]
        result = reg.import_cache([(str(path), cache)], scope=scope)
        path.unlink()
        return entries, result

    @staticmethod
    def _committed(record: dict[str, Any], result: WriteResult | _StartResult) -> None:
        if result.commit_id is None:
            record["outcome"] = "unchanged"
            return
        record["outcome"] = "committed"
        record["commit"] = result.commit_id
        record["counts"] = [result.added, result.replaced, result.removed]

    def _planned(
        self,
        make: Callable[[Registry, dict[str, Any]], Any],
        record: dict[str, Any],
        reg: Registry,
    ) -> WriteResult:
        """Make a plan (``make`` logs what it asks in ``record``) and execute it.

        A stale plan wrote nothing: it is made again, up to ``PLAN_ATTEMPTS``.
        """
        for attempt in range(PLAN_ATTEMPTS):
            plan = make(reg, record)
            try:
                result: WriteResult = plan.execute(reg)
            except ConflictError:
                record["retries"] = attempt + 1
                continue
            self._committed(record, result)
            return result
        raise _Stale

    # -- the fleet ----------------------------------------------------------

    def op_import(self, reg: Registry, record: dict[str, Any]) -> None:
        meta = FLEET[self.rng.choice(list(FLEET))]
        scope = self.rng.choice(FLEET_SCOPES)
        path = self._cache_file(meta, self.rng.randint(1, 12))
        entries, result = self._import(reg, path, scope)
        record["writes"] = [_entry_json(e) for e in entries]
        self._committed(record, result)

    def op_merge(self, reg: Registry, record: dict[str, Any]) -> None:
        from ficache.merge import plan_merge, read_sources

        policy = self.rng.choice(MERGE_POLICIES)
        paths = [
            self._cache_file(FLEET[self.rng.choice(list(FLEET))], self.rng.randint(1, 10))
            for _ in range(self.rng.randint(1, 3))
        ]
        specs = [str(p) for p in paths]
        if self.last_bundle is not None and self.rng.random() < 0.3:
            specs.insert(self.rng.randint(0, len(specs)), str(self.last_bundle))
        sources = read_sources(specs)
        for p in paths:
            p.unlink()
        record["policy"] = policy
        record["sources"] = len(sources)

        def make(reg: Registry, record: dict[str, Any]) -> Any:
            plan = plan_merge(reg, sources, policy)
            record["writes"] = [_entry_json(e) for e in plan.writes]
            record["removals"] = [[fp.digest, scope, k] for fp, scope, k in plan.removals]
            return plan

        self._planned(make, record, reg)

    def op_prune(self, reg: Registry, record: dict[str, Any]) -> None:
        ids = self._ids(reg)
        if self.rng.random() < 0.6:
            scope = self.rng.choice(FLEET_SCOPES[1:])
            fleet_ids = [ids[fp.digest] for fp in self.fleet.values() if fp.digest in ids]
            chosen = [self.rng.choice(fleet_ids)] if fleet_ids and self.rng.random() < 0.5 else []
            record["target"] = f"scope {scope}" + (f" of fingerprint {chosen[0]}" if chosen else "")

            def make(reg: Registry, record: dict[str, Any]) -> Any:
                plan = reg.plan_prune(scope=scope, fingerprint_ids=chosen)
                record["planned"] = plan.total
                return plan

        else:
            warm = ids.get(self.current.digest)
            if warm is None:
                record["outcome"] = "unchanged"
                return
            older_than = round(self.rng.uniform(0.0, 4.0), 3)
            record["target"] = f"warm starts' entries older than {older_than} s"

            def make(reg: Registry, record: dict[str, Any]) -> Any:
                plan = reg.plan_prune(fingerprint_ids=[warm], older_than_seconds=older_than)
                record["planned"] = plan.total
                return plan

        self._planned(make, record, reg)

    def op_warm_start(self, reg: Registry, record: dict[str, Any]) -> None:
        import ficache
        from ficache.standin import TACTICS, standin_tune
        from ficache.tuner import row_value

        reg.close()  # the start opens the registry itself, as a server does
        shapes = self.rng.sample(WARM_SHAPES, self.rng.randint(1, 2))
        tactic = self.rng.choice(TACTICS)
        with ficache.warm_start(None, db=self.db) as ws:
            standin_tune(shapes, force_tactic=tactic, repeat=1)
            tuned = ws.tuner.tuned()  # rows of 4: (runner, tactic, policy, selection)
        report = ws.report
        scope = SHARED_SCOPE if report.synchronized else rank_scope(report.layout, report.rank)
        record["keep_existing"] = True
        record["writes"] = [
            [report.fingerprint, scope, k, *row_value(row)] for k, row in sorted(tuned.items())
        ]
        record["loaded"] = report.loaded
        record["kept"] = report.kept
        if report.reason is not None or report.fingerprint != self.current.digest:
            raise RuntimeError(f"warm start: {report.status}: {report.reason}")
        # No commit with nothing failed: every tuned key was held by then (kept or equal).
        self._committed(record, _StartResult(report))

    def op_export(self, reg: Registry, record: dict[str, Any]) -> None:
        from ficache.flashinfer_format import read_cache_file, write_atomic

        ids = self._ids(reg)
        held = [ids[fp.digest] for fp in self.fleet.values() if fp.digest in ids]
        if not held:
            record["outcome"] = "ok"
            return
        scope = self.rng.choice(FLEET_SCOPES)
        text, count = reg.export_text(self.rng.choice(held), scope=scope)
        path = self._path(".json")
        write_atomic(path, text)
        exported = read_cache_file(path)
        path.unlink()
        if len(exported.entries) != count:
            raise RuntimeError(f"exported {count} entries, read back {len(exported.entries)}")
        record["entries"] = count
        record["outcome"] = "ok"

    def op_bundle(self, reg: Registry, record: dict[str, Any]) -> None:
        from ficache.bundle import read_bundle
        from ficache.exporting import write_bundle
        from ficache.importing import import_bundles

        ids = self._ids(reg)
        wanted = [fp.digest for fp in self.fleet.values()]
        if self.rng.random() < 0.5:
            wanted.append(self.current.digest)
        chosen = [ids[d] for d in wanted if d in ids]
        if not chosen:
            record["outcome"] = "unchanged"
            return
        path = self._path(".bundle")
        try:
            write_bundle(reg, path, chosen)
        except NotFoundError:  # every chosen fingerprint was pruned empty
            record["outcome"] = "unchanged"
            return
        bundle = read_bundle(path)
        record["writes"] = [_entry_json(e) for e in bundle.entries]
        result = import_bundles(reg, [(str(path), bundle)])
        self._committed(record, result)
        if self.last_bundle is not None:
            self.last_bundle.unlink()
        self.last_bundle = path

    def op_verify(self, reg: Registry, record: dict[str, Any]) -> None:
        from ficache.verify import verify

        report = verify(self.db)
        if not report.ok:
            raise RuntimeError("verify: " + "; ".join(p.message for p in report.problems[:3]))
        record["outcome"] = "ok"

    # -- the worker's own fingerprint ---------------------------------------

    def op_import_own(self, reg: Registry, record: dict[str, Any]) -> None:
        scope = self.rng.choice((SHARED_SCOPE, self.own_scope))
        path = self._cache_file(own_metadata(self.index), self.rng.randint(1, 10))
        before = dict(self.model)
        entries, result = self._import(reg, path, scope)
        record["writes"] = [_entry_json(e) for e in entries]
        self._committed(record, result)
        if result.commit_id is not None:
            for e in entries:
                self.model[(e.scope, e.key)] = (e.runner, e.tactic_json, e.policy_json)
            self.last_own = (result.commit_id, before)

    def op_prune_own(self, reg: Registry, record: dict[str, Any]) -> None:
        own_id = self._ids(reg).get(self.own.digest)
        if own_id is None:
            record["outcome"] = "unchanged"
            return
        held = sorted({s for s, _k in self.model}) or [SHARED_SCOPE, self.own_scope]
        scope = self.rng.choice(held)
        expected = sum(1 for s, _k in self.model if s == scope)
        record["target"] = f"own scope {scope}"

        def make(reg: Registry, record: dict[str, Any]) -> Any:
            plan = reg.plan_prune(fingerprint_ids=[own_id], scope=scope)
            record["planned"] = plan.total
            if plan.total != expected:
                raise RuntimeError(
                    f"own scope {scope} holds {plan.total} entries, the model {expected}"
                )
            return plan

        before = dict(self.model)
        result = self._planned(make, record, reg)
        if result.commit_id is not None:
            self.model = {sk: v for sk, v in self.model.items() if sk[0] != scope}
            self.last_own = (result.commit_id, before)

    def op_revert_own(self, reg: Registry, record: dict[str, Any]) -> None:
        if self.last_own is None:
            record["outcome"] = "unchanged"
            return
        commit_id, restored = self.last_own
        record["reverts"] = commit_id
        before = dict(self.model)
        result = reg.revert(commit_id)
        self._committed(record, result)
        if result.commit_id is not None:
            self.model = restored
            self.last_own = (result.commit_id, before)


def _die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies (Linux)."""
    libc = ctypes.CDLL(None, use_errno=True)
    pr_set_pdeathsig = 1
    if libc.prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    if os.getppid() != parent:  # the parent died before the prctl
        os._exit(1)


def run(config_path: str) -> int:
    """Fork the workers of the config at ``config_path``, wait for them; 0 when all ended well."""
    config = json.loads(Path(config_path).read_text())
    parent = os.getpid()
    pids: list[int] = []
    for index in range(int(config["workers"])):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 70
            try:
                _die_with_parent(parent)
                code = Worker(config, index).run(config["start_at"], config["end_at"])
            except BaseException:  # noqa: BLE001 - reported in the log, then the exit code
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    failed = []
    for index, pid in enumerate(pids):
        _, status = os.waitpid(pid, 0)
        code = os.waitstatus_to_exitcode(status)
        if code != 0:
            failed.append(f"worker {index} exited {code}")
    if failed:
        print("; ".join(failed), file=sys.stderr)
        return 1
    return 0
