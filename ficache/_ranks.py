"""Run one function on N local processes joined in one gloo group, under a hard timeout.

The demo, the benchmarks and the tests need real multi-process
``torch.distributed`` gloo groups on one machine. ``run_ranks`` starts N
fresh processes (``spawn``), joins them with ``init_process_group("gloo")``
on 127.0.0.1 and a free port, calls ``target(rank, world, *args)`` in each,
and returns the N return values (pickled through files, so a large result
can never block a process on its way out).

Invariants:
- Bounded: the parent waits at most ``timeout`` seconds in all, then kills
  every process still running and raises ``RanksTimeoutError`` naming them,
  so a deadlock fails the caller instead of hanging it.
- A rank that raises makes ``run_ranks`` raise ``RanksFailedError`` with
  that rank's traceback (the other ranks are still waited for, or killed).
- ``target`` must be a module-level function; ``args`` and its return value
  must pickle.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any


class RanksFailedError(RuntimeError):
    """A rank raised; the message holds its traceback."""


class RanksTimeoutError(TimeoutError):
    """Ranks were still running when the hard timeout expired; they were killed."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _child(
    rank: int,
    world: int,
    port: int,
    group_timeout: float,
    outdir: str,
    env: Mapping[str, str | None],
    target: Callable[..., Any],
    args: tuple[Any, ...],
) -> None:
    for key, value in env.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=group_timeout),
        )
        try:
            result = target(rank, world, *args)
        finally:
            with contextlib.suppress(Exception):
                dist.destroy_process_group()
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as handle:
            pickle.dump(result, handle)
    except BaseException:
        with open(os.path.join(outdir, f"rank{rank}.err"), "w") as handle:
            handle.write(traceback.format_exc())
        raise SystemExit(1) from None


def run_ranks(
    target: Callable[..., Any],
    world: int,
    *args: Any,
    timeout: float = 300.0,
    group_timeout: float = 60.0,
    env: Mapping[str, str | None] | None = None,
) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` gloo ranks; return their results."""
    if world < 1:
        raise ValueError(f"world must be at least 1, got {world}")
    outdir = tempfile.mkdtemp(prefix="ficache-ranks-")
    context = multiprocessing.get_context("spawn")
    port = free_port()
    procs = [
        context.Process(
            target=_child,
            args=(rank, world, port, group_timeout, outdir, dict(env or {}), target, args),
            name=f"ficache-rank{rank}",
        )
        for rank in range(world)
    ]
    started: list[Any] = []
    try:
        for proc in procs:
            proc.start()
            started.append(proc)
        _join_within(procs, world, timeout)
        _raise_first_failure(procs, world, outdir)
        return _results(world, outdir)
    finally:
        _stop(started)
        shutil.rmtree(outdir, ignore_errors=True)


def _join_within(procs: list[Any], world: int, timeout: float) -> None:
    """Wait for every process, at most ``timeout`` seconds in all; ``RanksTimeoutError``
    naming the ranks still running after that (the caller kills them)."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        proc.join(max(deadline - time.monotonic(), 0.0))
    stuck = [rank for rank, proc in enumerate(procs) if proc.is_alive()]
    if stuck:
        raise RanksTimeoutError(
            f"rank(s) {', '.join(map(str, stuck))} of {world} still running after {timeout:g} s; killed"
        )


def _raise_first_failure(procs: list[Any], world: int, outdir: str) -> None:
    """``RanksFailedError`` with the first failed rank's traceback (or exit code), naming
    the other failed ranks; nothing when every rank succeeded."""
    failed = []
    for rank in range(world):
        err = os.path.join(outdir, f"rank{rank}.err")
        if os.path.exists(err):
            with open(err) as handle:
                failed.append((rank, handle.read()))
        elif procs[rank].exitcode != 0:
            failed.append((rank, f"exit code {procs[rank].exitcode}"))
    if failed:
        rank, text = failed[0]
        others = (
            f" (and rank(s) {', '.join(str(r) for r, _ in failed[1:])})" if len(failed) > 1 else ""
        )
        raise RanksFailedError(f"rank {rank} of {world} failed{others}:\n{text}")


def _results(world: int, outdir: str) -> list[Any]:
    """Each rank's pickled return value, in rank order."""
    results = []
    for rank in range(world):
        with open(os.path.join(outdir, f"rank{rank}.pkl"), "rb") as handle:
            results.append(pickle.load(handle))
    return results


def _stop(started: list[Any]) -> None:
    """Terminate every started process still running, then kill what outlives 5 s."""
    for proc in started:
        if proc.is_alive():
            proc.terminate()
    for proc in started:
        proc.join(5)
        if proc.is_alive():
            proc.kill()
            proc.join(5)
