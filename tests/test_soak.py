"""Sustained load: many processes doing warm starts, imports, merges, prunes,
reverts, exports, bundle round trips and verifies on one registry, on SQLite and
on PostgreSQL; then nothing is lost and the registry verifies.

The load (``tests/soak_load.py``): ``FICACHE_SOAK_WORKERS`` processes (default
8), forked from the forker (``tests/forker.py``: torch imported once), each
drawing operations from a seeded RNG for ``FICACHE_SOAK_SECONDS`` (default 20:
CI-sized; ``FICACHE_SOAK_SECONDS=600 pytest -m soak tests/test_soak.py`` is
the long soak; ``FICACHE_SOAK_SEED`` repeats a draw). Every test here is marked
``soak``, so ``-m soak`` selects exactly the soak and ``-m "not soak"`` leaves
it out.

Measured and printed (and recorded for RELIABILITY.md): operations per second,
p50/p99 commit latency per operation kind (from asking for the write lock to
the commit, retries included) and per whole operation, conflicts (a merge or
prune plan refused because a concurrent commit changed its entries: the
designed outcome, retried) and errors (anything else; expected 0).

Checked after the load (all at once; the case fails listing every miss):
- no operation failed, and every worker ran to its end;
- ``ficache.verify`` finds nothing wrong (it replays the change log too);
- the registry's commits are exactly the ones the workers were told they
  made (nothing lost, nothing extra), each of the kind and with the counts
  its writer got back;
- a serial replay of the change log in commit order, checked at each commit
  against what its writer asked for, ends in exactly the registry's
  entries: an import's or bundle's entries are each written or were
  already held; a merge writes and removes exactly its plan; a warm start
  adds only keys nobody held (the value committed first wins) and leaves
  the rest; a prune removes exactly as many entries as it planned;
- each worker's own fingerprint, written only by that worker, holds exactly
  what the worker's own serial model of its imports, prunes and reverts
  says.

No duration is compared with a number. The workers' parent runs under a hard
deadline (the load's length plus ``GRACE_S``), past which it is killed (its
workers die with it) and the test fails.
"""

from __future__ import annotations

import json
import os
import random
import statistics
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import soak_load
from forker import Forker
from reliability_log import record
from sqlalchemy import text

from ficache.registry import Registry
from ficache.verify import verify

SOAK_SECONDS = float(os.environ.get("FICACHE_SOAK_SECONDS", "20"))
WORKERS = int(os.environ.get("FICACHE_SOAK_WORKERS", "8"))
SEED = int(os.environ.get("FICACHE_SOAK_SEED") or random.SystemRandom().randrange(2**32))
#: Hard deadline past the load's end, for the last operations, the exit and a loaded machine.
GRACE_S = 300.0
#: Time for every worker to be forked before the shared start.
START_DELAY_S = 2.0

pytestmark = pytest.mark.soak

#: Runs a test on SQLite and on PostgreSQL (``registry_db`` follows ``backend``).
both_backends = pytest.mark.usefixtures("backend")

Ident = tuple[str, str, str]
Value = tuple[str, str, str | None]


def percentile(values: list[float], q: float) -> float:
    """The nearest-rank ``q`` percentile (0 < q <= 100) of ``values``."""
    ordered = sorted(values)
    rank = max(1, -(-len(ordered) * q // 100))
    return ordered[int(rank) - 1]


def read_operations(out: Path) -> list[dict[str, Any]]:
    ops: list[dict[str, Any]] = []
    for log in sorted(out.glob("worker-*.jsonl")):
        ops.extend(json.loads(line) for line in log.read_text().splitlines())
    return ops


def registry_log(db: str) -> tuple[dict[int, tuple[Any, ...]], list[Any], dict[Ident, Value]]:
    """Commits by id, change rows in id order, and the entries, with digests for ids."""
    with Registry.open(db, create=False) as reg, reg.engine.connect() as conn:
        commits = {
            row[0]: tuple(row[1:])
            for row in conn.execute(
                text("SELECT id, kind, added, replaced, removed, reverts_commit_id FROM commits")
            )
        }
        changes = list(
            conn.execute(
                text(
                    "SELECT h.commit_id, f.digest, h.scope, h.key, h.action, "
                    "h.new_runner, h.new_tactic, p.policy AS new_policy "
                    "FROM entry_changes h JOIN fingerprints f ON f.id = h.fingerprint_id "
                    "LEFT JOIN policies p ON p.id = h.new_policy_id "
                    "ORDER BY h.id"
                )
            )
        )
        entries = {
            (row[0], row[1], row[2]): (row[3], row[4], row[5])
            for row in conn.execute(
                text(
                    "SELECT f.digest, e.scope, e.key, e.runner, e.tactic, p.policy "
                    "FROM entries e JOIN fingerprints f ON f.id = e.fingerprint_id "
                    "LEFT JOIN policies p ON p.id = e.policy_id"
                )
            )
        }
    return commits, changes, entries


def check_commit(
    op: dict[str, Any], changes: list[Any], state: dict[Ident, Value], misses: list[str]
) -> None:
    """Check one commit's change rows against what its writer asked, before replaying them."""
    where = f"commit {op['commit']} ({op['op']} by worker {op['worker']})"
    changed = {(c.digest, c.scope, c.key): c for c in changes}
    if len(changed) != len(changes):
        misses.append(f"{where}: one entry changed twice")
    if "writes" not in op:  # prune, revert: their counts are checked; verify checks reverts
        if op["op"].startswith("prune") and len(changes) != op.get("planned"):
            misses.append(f"{where}: removed {len(changes)} of {op.get('planned')} planned")
        return
    asked: set[Ident] = set()
    for digest, scope, key, runner, tactic, policy in op["writes"]:
        ident, value = (digest, scope, key), (runner, tactic, policy)
        asked.add(ident)
        change = changed.get(ident)
        if change is None:
            if state.get(ident) != value and not (op.get("keep_existing") and ident in state):
                misses.append(f"{where}: {ident} neither written nor already held")
        elif op.get("keep_existing") and change.action != "added":
            misses.append(f"{where}: {ident} {change.action}, but a start only adds")
        elif (change.new_runner, change.new_tactic, change.new_policy) != value:
            misses.append(f"{where}: {ident} written with another value than asked")
    for digest, scope, key in op.get("removals", ()):
        ident = (digest, scope, key)
        asked.add(ident)
        change = changed.get(ident)
        if (change is None and ident in state) or (
            change is not None and change.action != "removed"
        ):
            misses.append(f"{where}: {ident} was to be removed")
    if set(changed) - asked:
        misses.append(f"{where}: {len(set(changed) - asked)} changes nobody asked for")


def replay(
    ops: list[dict[str, Any]],
    commits: dict[int, tuple[Any, ...]],
    changes: list[Any],
    misses: list[str],
) -> dict[Ident, Value]:
    """Replay the change log in commit order, checking each commit against its request."""
    by_commit: dict[int, list[Any]] = {}
    for change in changes:
        by_commit.setdefault(change.commit_id, []).append(change)
    made = {op["commit"]: op for op in ops if "commit" in op}
    state: dict[Ident, Value] = {}
    for commit_id in sorted(commits):
        kind, added, replaced, removed, _reverts = commits[commit_id]
        rows = by_commit.get(commit_id, [])
        op = made.get(commit_id)
        if op is None:
            misses.append(f"commit {commit_id} ({kind}) was made by no worker")
        else:
            if (
                kind != soak_load.COMMIT_KIND[op["op"]]
                or [added, replaced, removed] != op["counts"]
            ):
                misses.append(
                    f"commit {commit_id}: {kind} {[added, replaced, removed]} in the registry, "
                    f"{op['op']} {op['counts']} reported to worker {op['worker']}"
                )
            check_commit(op, rows, state, misses)
        for c in rows:
            ident = (c.digest, c.scope, c.key)
            if (c.action == "added") == (ident in state):
                misses.append(f"commit {commit_id}: {c.action} {ident}, held: {ident in state}")
            if c.action == "removed":
                state.pop(ident, None)
            else:
                state[ident] = (c.new_runner, c.new_tactic, c.new_policy)
    lost = sorted(set(made) - set(commits))
    if lost:
        misses.append(
            f"{len(lost)} commits reported to workers are not in the registry: {lost[:5]}"
        )
    return state


def latency_table(ops: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    table: dict[str, dict[str, float]] = {}
    for kind in soak_load.WEIGHTS:
        mine = [op for op in ops if op["op"] == kind]
        if not mine:
            continue
        committed = [op["commit_s"] for op in mine if "commit" in op]
        table[kind] = {
            "ops": len(mine),
            "commits": len(committed),
            "op_p50_ms": 1000 * statistics.median(op["op_s"] for op in mine),
            "op_p99_ms": 1000 * percentile([op["op_s"] for op in mine], 99),
        }
        if committed:
            table[kind]["commit_p50_ms"] = 1000 * statistics.median(committed)
            table[kind]["commit_p99_ms"] = 1000 * percentile(committed, 99)
    return table


@both_backends
def test_sustained_load_loses_nothing_and_verifies(
    backend: str, registry_db: str, forker: Forker, tmp_path: Path, request: pytest.FixtureRequest
) -> None:
    Registry.open(registry_db).close()  # at head before the load
    out = tmp_path / "soak"
    out.mkdir()
    start_at = time.time() + START_DELAY_S
    config = {
        "db": registry_db,
        "workers": WORKERS,
        "seed": f"{SEED}/{backend}",
        "out": str(out),
        "start_at": start_at,
        "end_at": start_at + SOAK_SECONDS,
    }
    config_path = tmp_path / "soak.json"
    config_path.write_text(json.dumps(config))
    child = forker.spawn(
        "call",
        ["soak_load:run", str(config_path)],
        deadline_s=START_DELAY_S + SOAK_SECONDS + GRACE_S,
    )
    code = child.reap()
    log = child.log.read_text(errors="replace")

    misses: list[str] = []
    if code != 0:
        misses.append(f"the workers' parent exited {code}: {log[-3000:]}")
    ops = read_operations(out)
    outcomes = Counter(op["outcome"] for op in ops)
    errors = [op for op in ops if op["outcome"] == "error"]
    misses.extend(f"worker {op['worker']} {op['op']}: {op['error']}" for op in errors[:10])
    report = verify(registry_db)
    if not report.ok:
        misses.append("verify: " + "; ".join(p.message for p in report.problems[:5]))
    commits, changes, entries = registry_log(registry_db)
    final = replay(ops, commits, changes, misses)
    if final != entries:
        diff = set(final.items()) ^ set(entries.items())
        misses.append(f"the replay and the registry differ in {len(diff)} entries")
    models = 0
    for path in sorted(out.glob("worker-*-model.json")):
        model = json.loads(path.read_text())
        held = {
            (scope, key): value
            for (digest, scope, key), value in entries.items()
            if digest == model["digest"]
        }
        expected = {(s, k): (r, t, p) for s, k, r, t, p in model["entries"]}
        models += 1
        if held != expected:
            misses.append(f"{path.name}: the registry holds {len(held)}, expected {len(expected)}")
    if models != WORKERS:
        misses.append(f"{models} of {WORKERS} workers wrote their model")

    first = min(op["started"] for op in ops)
    last = max(op["started"] + op["op_s"] for op in ops)
    elapsed = last - first
    table = latency_table(ops)
    committed = [op["commit_s"] for op in ops if "commit" in op]
    kinds = Counter(op["op"] for op in ops)
    figures: dict[str, int | float | str] = {
        "workers": WORKERS,
        "seconds": round(elapsed, 1),
        "seed": SEED,
        "operations": len(ops),
        "ops_per_s": round(len(ops) / elapsed, 1),
        "commits": len(commits),
        "commits_per_s": round(len(commits) / elapsed, 1),
        "commit_p50_ms": round(1000 * statistics.median(committed), 1) if committed else 0,
        "commit_p99_ms": round(1000 * percentile(committed, 99), 1) if committed else 0,
        "conflicts": outcomes["conflict"],
        "plan_retries": sum(op["retries"] for op in ops),
        "errors": outcomes["error"],
        "entries": len(entries),
        "changes_replayed": len(changes),
        "verify_clean": int(report.ok),
        **{f"{kind}_ops": n for kind, n in sorted(kinds.items())},
        **{
            f"{kind}_commit_{q}_ms": round(row[f"commit_{q}_ms"], 1)
            for kind, row in table.items()
            if "commit_p99_ms" in row
            for q in ("p50", "p99")
        },
    }
    print(f"\nsoak on {backend}: {WORKERS} workers, {elapsed:.1f} s, seed {SEED}")
    print(
        f"{'operation':<12} {'ops':>5} {'commits':>7} {'commit p50':>10} {'p99 ms':>8} "
        f"{'op p50':>8} {'p99 ms':>8}"
    )
    for kind, row in table.items():
        print(
            f"{kind:<12} {row['ops']:>5.0f} {row['commits']:>7.0f} "
            f"{row.get('commit_p50_ms', 0):>10.1f} {row.get('commit_p99_ms', 0):>8.1f} "
            f"{row['op_p50_ms']:>8.1f} {row['op_p99_ms']:>8.1f}"
        )
    print(json.dumps(figures))
    assert not misses, "\n".join(misses[:30])
    assert len(ops) >= WORKERS and len(commits) > 0
    record(
        item="8. sustained load",
        test=request.node.nodeid,
        backend=backend,
        applied=(
            f"{WORKERS} processes for {SOAK_SECONDS:g} s: {len(ops)} operations "
            f"({', '.join(f'{n} {k}' for k, n in sorted(kinds.items()))})"
        ),
        outcome=(
            f"{figures['ops_per_s']} ops/s, {len(commits)} commits, commit latency "
            f"p50 {figures['commit_p50_ms']} ms / p99 {figures['commit_p99_ms']} ms, "
            f"{outcomes['conflict']} stale plans refused, {outcomes['error']} errors, "
            f"verify {'clean' if report.ok else 'NOT clean'}, "
            f"replay {'equal' if final == entries else 'DIFFERS'} ({len(changes)} changes)"
        ),
        ok=not misses,
        figures=figures,
    )
