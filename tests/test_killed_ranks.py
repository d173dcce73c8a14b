"""Killed and slow ranks: SIGKILL one rank at each phase of a warm start (issue 10 item 5).

Real gloo ranks (multi-process ``torch.distributed``), the real AutoTuner
filled by the CPU stand-in (``ficache.standin``), a real registry holding 12
of the stand-in's 18 keys: every start loads 12 entries, tunes 6 and would
commit them, so every phase of the protocol (``ficache.sync``) runs:

=========  ================================================  ==========================
phase      where the kill lands (wrapped in the child)        killed by
=========  ================================================  ==========================
export     ``WarmStart._export_payload`` (rank 0 only)        rank 0, as it starts exporting
broadcast  the first ``_Channel.broadcast`` (the slices)      the victim itself
load       the first ``WarmStart._load_slice``                the victim itself
tuning     the 3rd tuning ``all_reduce`` (in the block)       the victim itself
exchange   the first ``_Channel.exchange`` (status)           the victim itself
gather     the first ``_Channel.gather`` (tuned entries)      the victim itself
commit     rank 0's write transaction, body done, not yet     rank 0 (inside its commit)
           committed (victim rank 0); entry to
           ``WarmStart._commit`` (another victim)
=========  ================================================  ==========================

The hooks wrap functions inside the child processes only (the product has
no kill switch): the wrapper writes when and where it struck, then
``os.kill(pid, SIGKILL)``. For export and commit (rank 0's phases) rank 0
kills the victim at that moment: itself, or a peer that dies while rank 0
exports or commits. A *slow* rank sleeps ``SLOW_S`` (longer than the
timeout) at its phase instead.

What every case checks:
- Every survivor ends by itself (the hard guard, ``HARD_KILL_S``, kills a
  rank that hangs and fails the test) with one clear one-line error in its
  report, and, for a kill, the wait ended because the peer's connection
  closed ("Connection closed/reset by peer"), not because a timeout ran out;
  for a slow rank, because the protocol's timeout ran out.
- For a slow rank, the bound ``warm_start`` promises: a stalled peer costs each
  survivor the warm start's ``timeout`` once, not twice. The gloo group's own
  timeout is set far apart (``GROUP_TIMEOUT_S``, 6 times the warm start's), so
  a wait that only gloo ends cannot pass for one ficache ended, and every
  survivor's end, counted from the moment of the stall, must come before
  ``CEILING_S``: the timeout, plus the exchange's two ``release_grace`` waits,
  plus slack for a loaded machine, well under twice the timeout. Normal work
  and the kill cases are never compared with a duration.
- The registry holds nothing new or exactly one whole commit (6 shared
  entries, counted in its commit row), and passes ``ficache verify``.
- The slowest survivor exit (seconds from the kill, or from the slow rank's
  stall, to the survivor's end) is printed and recorded
  (``reliability_log.record``).

Cost. The ranks are forked from a forkserver that imported torch, FlashInfer
and ficache once (a fresh interpreter costs ~8 s here); a case takes 1-3 s,
a slow case about 2.5 times the timeout (25 s). CI runs world 2 (every phase,
rank 0 and rank 1), the slow cases and world 3 with rank 2 killed at every
phase (about 2.5 minutes here); ``FICACHE_KILLED_RANKS_FULL=1`` adds world 4
with every rank killed at every phase (marked ``slow``). PostgreSQL
(``postgres`` marker): a representative subset with rank 0's registry on
PostgreSQL.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import multiprocessing
import os
import re
import shutil
import signal
import socket
import sqlite3
import time
import traceback
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from reliability_log import record

ITEM = "killed and slow ranks"
#: The protocol's bound: the warm start's ``timeout``.
TIMEOUT_S = 10.0
RELEASE_GRACE_S = 1.0
#: The gloo group's own timeout, far from the warm start's: a wait that only gloo's
#: timeout ends shows as a survivor ending after this long, well past ``CEILING_S``.
GROUP_TIMEOUT_S = 6 * TIMEOUT_S
#: A slow rank stalls this long at its phase: well past the timeout (a rank that hangs
#: there, as far as its peers can tell, but that comes back: it must end too).
SLOW_S = 2.5 * TIMEOUT_S
#: What a stalled peer may cost its survivors, from the stall to their end: the
#: timeout once, plus the grace waits of the status exchange (``release_grace`` before
#: releasing the tuning group, and again after a tuning collective timed out), plus
#: slack for a loaded machine; well below twice the timeout, which a survivor that
#: waits the timeout a second time (21 s here) exceeds.
CEILING_S = TIMEOUT_S + 2 * RELEASE_GRACE_S + 0.4 * TIMEOUT_S
#: Hang guard for one case: every rank still running is killed and the case fails.
HARD_KILL_S = 120.0
PHASES = ("export", "broadcast", "load", "tuning", "exchange", "gather", "commit")
FULL = os.environ.get("FICACHE_KILLED_RANKS_FULL", "") not in ("", "0")
PRELOAD = ["torch", "torch.distributed", "flashinfer.autotuner", "ficache.sync", "ficache.standin"]

#: "closed" or "reset": which one gloo says depends on which side saw the socket go first.
PEER_GONE = re.compile(r"Connection (closed|reset) by peer|Broken pipe|Connection refused")
TIMED_OUT = re.compile(r"timed out|timeout", re.IGNORECASE)


# --------------------------------------------------------------------------
# In the rank processes


def _write_json(path: Path, data: Any) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def _install_fault(rank: int, case: dict[str, Any], workdir: Path) -> None:
    """Wrap the function where ``case``'s fault strikes (see the module docstring)."""
    import torch.distributed as dist

    from ficache import schema, sync

    phase, victim, mode = case["phase"], case["victim"], case["mode"]

    def strike() -> None:
        _write_json(
            workdir / "struck.json",
            {"at": time.time(), "by": rank, "victim": victim, "phase": phase, "mode": mode},
        )
        if mode == "slow":
            time.sleep(SLOW_S)
            return
        pid = int((workdir / f"pid{victim}").read_text())
        os.kill(pid, signal.SIGKILL)
        if pid == os.getpid():  # never reached: SIGKILL cannot be caught
            time.sleep(3600)

    def wrap(owner: Any, name: str, nth: int = 1, when: Callable[[], bool] = lambda: True) -> None:
        real = getattr(owner, name)
        calls = [0]

        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if when():
                calls[0] += 1
                if calls[0] == nth:
                    strike()
            return real(*args, **kwargs)

        setattr(owner, name, wrapper)

    striker = 0 if phase in ("export", "commit") else victim
    if rank != striker:
        return
    if phase == "export":
        wrap(sync.WarmStart, "_export_payload")
    elif phase == "broadcast":
        wrap(sync._Channel, "broadcast")
    elif phase == "load":
        wrap(sync.WarmStart, "_load_slice")
    elif phase == "tuning":
        wrap(dist, "all_reduce", nth=3)
    elif phase == "exchange":
        wrap(sync._Channel, "exchange")
    elif phase == "gather":
        wrap(sync._Channel, "gather")
    elif phase == "commit" and victim != 0:
        wrap(sync.WarmStart, "_commit")
    elif phase == "commit":
        committing = [False]
        real_commit = sync.WarmStart._commit
        real_transaction = schema.write_transaction

        def commit(self: Any, *args: Any, **kwargs: Any) -> Any:
            committing[0] = True
            return real_commit(self, *args, **kwargs)

        @contextlib.contextmanager
        def transaction(engine: Any) -> Iterator[Any]:
            with real_transaction(engine) as conn:
                yield conn
                if committing[0]:
                    strike()  # every row written, the transaction not yet committed

        sync.WarmStart._commit = commit  # type: ignore[method-assign]
        schema.write_transaction = transaction  # type: ignore[assignment]
    else:
        raise ValueError(f"unknown phase {phase!r}")


def rank_main(rank: int, world: int, port: int, case: dict[str, Any], workdir: str) -> None:
    """One rank of one case: join the group, arm the fault, warm start, write what happened."""
    work = Path(workdir)
    (work / f"pid{rank}").write_text(str(os.getpid()))
    os.environ["XDG_CACHE_HOME"] = str(work / f"user-cache{rank}")
    import logging

    import torch
    import torch.distributed as dist

    from ficache.standin import standin_tune
    from ficache.sync import warm_start

    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank, "exception": None}
    try:
        if world > 1:
            dist.init_process_group(
                "gloo",
                init_method=f"tcp://127.0.0.1:{port}",
                rank=rank,
                world_size=world,
                timeout=datetime.timedelta(seconds=GROUP_TIMEOUT_S),
            )
            _install_fault(rank, case, work)
        out["started_at"] = time.time()
        try:
            with warm_start(
                None, db=case["db"], timeout=TIMEOUT_S, release_grace=RELEASE_GRACE_S
            ) as ws:
                standin_tune(shapes=case.get("shapes") or ((128, 128), (128, 256), (256, 128)))
        except Exception as exc:  # noqa: BLE001 - recorded for the test
            out["exception"] = f"{type(exc).__name__}: {exc}"
        out["report"] = ws.report.as_json()
    except BaseException:  # noqa: BLE001
        out["error"] = traceback.format_exc()
    out["ended_at"] = time.time()
    _write_json(work / f"rank{rank}.json", out)
    # Leave without tearing down gloo (a dead peer may make a teardown wait).
    os._exit(0)


# --------------------------------------------------------------------------
# In pytest


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def forkserver() -> Any:
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


@dataclass
class Outcome:
    exit_codes: list[int | None]
    results: dict[int, dict[str, Any]]
    struck: dict[str, Any] | None
    hung: list[int]


def run_world(context: Any, world: int, case: dict[str, Any], workdir: Path) -> Outcome:
    """Run one case on ``world`` ranks under the hard guard."""
    workdir.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    procs = [
        context.Process(
            target=rank_main, args=(rank, world, port, case, str(workdir)), name=f"rank{rank}"
        )
        for rank in range(world)
    ]
    for proc in procs:
        proc.start()
    deadline = time.monotonic() + HARD_KILL_S
    try:
        for proc in procs:
            proc.join(max(deadline - time.monotonic(), 0.0))
    finally:
        hung = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join(10)
    results = {}
    for rank in range(world):
        path = workdir / f"rank{rank}.json"
        if path.exists():
            results[rank] = json.loads(path.read_text())
    struck_path = workdir / "struck.json"
    struck = json.loads(struck_path.read_text()) if struck_path.exists() else None
    return Outcome([p.exitcode for p in procs], results, struck, hung)


def _sql(db: str, statement: str) -> list[tuple[Any, ...]]:
    if "://" not in db:
        conn = sqlite3.connect(db)
        try:
            return conn.execute(statement).fetchall()
        finally:
            conn.close()
    from sqlalchemy import create_engine, text
    from sqlalchemy.pool import NullPool

    engine = create_engine(db, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            return [tuple(row) for row in conn.execute(text(statement))]
    finally:
        engine.dispose()


def registry_state(db: str) -> dict[str, Any]:
    """Commits (id, kind, added, replaced, removed, change rows) and entries per scope."""
    commits = _sql(
        db,
        "SELECT c.id, c.kind, c.added, c.replaced, c.removed, "
        "(SELECT count(*) FROM entry_changes h WHERE h.commit_id = c.id) "
        "FROM commits c ORDER BY c.id",
    )
    scopes = _sql(db, "SELECT scope, count(*) FROM entries GROUP BY scope ORDER BY scope")
    return {"commits": [list(c) for c in commits], "scopes": {s: n for s, n in scopes}}


#: The registry every case starts from: one warm start's commit of 12 shared entries.
BEFORE = {"commits": [[1, "startup", 12, 0, 0, 12]], "scopes": {"shared": 12}}
#: ... and after this case's start commits, whole: 6 more shared entries in commit 2.
AFTER = {
    "commits": [[1, "startup", 12, 0, 0, 12], [2, "startup", 6, 0, 0, 6]],
    "scopes": {"shared": 18},
}


def prepare(context: Any, db: str, workdir: Path) -> None:
    """One rank alone commits 12 of the stand-in's keys into ``db``."""
    setup = {"db": db, "shapes": [[128, 128], [128, 256]], "phase": None, "victim": None}
    out = run_world(context, 1, {**setup, "mode": None}, workdir)
    result = out.results.get(0, {})
    assert out.exit_codes == [0] and "error" not in result, out
    assert result["report"]["committed"] == 12, result["report"]
    assert registry_state(db) == BEFORE


@pytest.fixture(scope="module")
def base_registry(forkserver: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    work = tmp_path_factory.mktemp("killed-ranks-base")
    db = work / "registry.db"
    prepare(forkserver, str(db), work / "setup")
    conn = sqlite3.connect(db)
    conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")
    conn.close()
    return db


def survivor_error(result: dict[str, Any]) -> str | None:
    """The one error a survivor reports: why nothing was committed (or loaded), or what raised."""
    report = result.get("report") or {}
    return report.get("reason") or result.get("exception")


def check_case(
    name: str,
    world: int,
    case: dict[str, Any],
    out: Outcome,
    db: str,
    backend: str,
) -> None:
    """Assert what every case must show; print and record the slowest survivor exit."""
    victim, mode = case["victim"], case["mode"]
    struck = out.struck
    survivors = [r for r in range(world) if r != victim]
    state = registry_state(db)
    verified = _verify(db)
    ends = {r: out.results[r]["ended_at"] - struck["at"] for r in out.results} if struck else {}
    slowest = max((ends[r] for r in survivors if r in ends), default=None)
    slow_rank_end = ends.get(victim) if mode == "slow" else None
    errors = {r: survivor_error(result) for r, result in out.results.items()}
    whole = (
        "nothing committed" if state == BEFORE else "one whole commit" if state == AFTER else "?"
    )
    fault = "SIGKILL" if mode == "kill" else f"{SLOW_S:g} s stall"
    outcome = (
        f"{sum(r in ends for r in survivors)}/{len(survivors)} survivors ended with one error, "
        f"slowest {slowest:.2f} s after the {fault}"
        if slowest is not None
        else f"no survivor ended ({'struck' if struck else 'never struck'})"
    )
    if slow_rank_end is not None:
        outcome += f" (the slow rank itself: {slow_rank_end:.2f} s)"
    outcome += f"; registry: {whole}; verify {'clean' if verified else 'NOT CLEAN'}"
    print(f"{name}: {outcome}")
    for r, text in sorted(errors.items()):
        print(f"  rank {r}: {text}")
    ok = (
        struck is not None
        and not out.hung
        and all(r in out.results for r in survivors)
        and state in (BEFORE, AFTER)
        and verified
        and (mode != "slow" or (slowest is not None and slowest < CEILING_S))
    )
    figures: dict[str, float | int | str] = {
        "timeout_s": TIMEOUT_S,
        "group_timeout_s": GROUP_TIMEOUT_S,
    }
    if mode == "slow":
        figures["ceiling_s"] = CEILING_S
    if slowest is not None:
        figures["slowest_survivor_exit_s"] = round(slowest, 3)
    if slow_rank_end is not None:
        figures["slow_rank_exit_s"] = round(slow_rank_end, 3)

    assert struck is not None, f"the fault never struck: {out}"
    assert struck["phase"] == case["phase"] and struck["victim"] == victim
    assert not out.hung, f"rank(s) {out.hung} hung until the {HARD_KILL_S:g} s guard: {out}"
    if mode == "kill":
        assert out.exit_codes[victim] == -signal.SIGKILL
        assert victim not in out.results
    else:  # the slow rank ends too, by itself
        assert out.exit_codes[victim] == 0 and victim in out.results, out
        assert "error" not in out.results[victim], out.results[victim]["error"]
    for r in survivors:
        assert out.exit_codes[r] == 0 and r in out.results, (r, out)
        result = out.results[r]
        assert "error" not in result, result["error"]
        text = errors[r]
        if state == AFTER and r == 0:
            # Rank 0 committed whole, after its peer died: its report says so.
            assert (result["report"]["committed"], result["report"]["commit_id"]) == (6, 2)
            continue
        assert text is not None and "\n" not in text, (r, text)
        assert result["report"]["committed"] == 0, (r, result["report"])
        if mode == "kill":
            # The wait ended because the peer went away, not because a timeout ran out.
            assert PEER_GONE.search(text), (r, text)
            assert not TIMED_OUT.search(text), (r, text)
        else:
            # The wait for the slow rank ended because the protocol's timeout ran out.
            assert TIMED_OUT.search(text), (r, text)
    if mode == "slow":
        # The bound warm_start promises, from the stall: its timeout once (plus its
        # grace waits), not twice, and never the gloo group's far longer timeout.
        assert slowest is not None and slowest < CEILING_S, (
            f"a survivor ended {slowest:.2f} s after the {SLOW_S:g} s stall; a stalled peer "
            f"may cost it at most {CEILING_S:g} s (timeout {TIMEOUT_S:g} s, release_grace "
            f"{RELEASE_GRACE_S:g} s, gloo group's timeout {GROUP_TIMEOUT_S:g} s)"
        )
    assert state in (BEFORE, AFTER), state
    assert verified
    record(
        item=ITEM,
        test=name,
        applied=f"world {world}: {fault} of rank {victim} at {case['phase']} "
        f"(timeout {TIMEOUT_S:g} s, gloo group's {GROUP_TIMEOUT_S:g} s)",
        outcome=outcome,
        ok=ok,
        backend=backend,
        figures=figures,
    )


def _verify(db: str) -> bool:
    from ficache.verify import verify

    return verify(db).ok


def _case(phase: str, victim: int, mode: str = "kill") -> dict[str, Any]:
    return {"phase": phase, "victim": victim, "mode": mode}


def run_sqlite_case(
    context: Any, base: Path, tmp_path: Path, world: int, case: dict[str, Any]
) -> None:
    db = tmp_path / "registry.db"
    shutil.copy(base, db)
    out = run_world(context, world, {**case, "db": str(db)}, tmp_path / "ranks")
    name = f"world{world} {case['mode']} rank {case['victim']} at {case['phase']}"
    check_case(name, world, case, out, str(db), "sqlite")


# --------------------------------------------------------------------------


KILLS_WORLD2 = [pytest.param(p, v, id=f"{p}-rank{v}") for p in PHASES for v in (0, 1)]


@pytest.mark.parametrize(("phase", "victim"), KILLS_WORLD2)
def test_a_rank_killed_at_each_phase(
    phase: str, victim: int, forkserver: Any, base_registry: Path, tmp_path: Path
) -> None:
    run_sqlite_case(forkserver, base_registry, tmp_path, 2, _case(phase, victim))


SLOW = [
    pytest.param("export", 0, id="export-rank0"),  # a registry slower than the timeout
    pytest.param("tuning", 1, id="tuning-rank1"),  # a rank stalls inside its tuning
    pytest.param("exchange", 1, id="exchange-rank1"),  # a rank's block outlasts the timeout
]


@pytest.mark.parametrize(("phase", "victim"), SLOW)
def test_a_rank_slower_than_the_timeout(
    phase: str, victim: int, forkserver: Any, base_registry: Path, tmp_path: Path
) -> None:
    run_sqlite_case(forkserver, base_registry, tmp_path, 2, _case(phase, victim, "slow"))


WORLD3 = [pytest.param(p, id=f"{p}-rank2") for p in PHASES]


@pytest.mark.parametrize("phase", WORLD3)
def test_another_rank_of_three_killed_at_each_phase(
    phase: str, forkserver: Any, base_registry: Path, tmp_path: Path
) -> None:
    run_sqlite_case(forkserver, base_registry, tmp_path, 3, _case(phase, 2))


WORLD4 = [pytest.param(p, v, id=f"{p}-rank{v}") for p in PHASES for v in (0, 1, 2, 3)]


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the world-4 matrix runs with FICACHE_KILLED_RANKS_FULL=1")
@pytest.mark.parametrize(("phase", "victim"), WORLD4)
def test_any_rank_of_four_killed_at_each_phase(
    phase: str, victim: int, forkserver: Any, base_registry: Path, tmp_path: Path
) -> None:
    run_sqlite_case(forkserver, base_registry, tmp_path, 4, _case(phase, victim))


POSTGRES = [
    pytest.param("export", 0, id="export-rank0"),
    pytest.param("gather", 1, id="gather-rank1"),
    pytest.param("commit", 0, id="commit-rank0"),
    pytest.param("commit", 1, id="commit-rank1"),
]


@pytest.mark.postgres
@pytest.mark.parametrize(("phase", "victim"), POSTGRES)
def test_a_rank_killed_with_the_registry_on_postgres(
    phase: str, victim: int, forkserver: Any, postgres_url: str, tmp_path: Path
) -> None:
    prepare(forkserver, postgres_url, tmp_path / "setup")
    case = _case(phase, victim)
    out = run_world(forkserver, 2, {**case, "db": postgres_url}, tmp_path / "ranks")
    check_case(f"world2 kill rank {victim} at {phase}", 2, case, out, postgres_url, "postgres")
