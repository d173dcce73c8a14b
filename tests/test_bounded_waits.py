"""The warm start's bounded waits on real gloo ranks: a wait of zero seconds is a short wait.

torch's ``Work.wait`` reads a timeout under 1 ms as "no timeout": a wait whose
bound is zero (``release_grace=0``, or a deadline already passed between the
two broadcasts of one ``_Channel.broadcast``) would wait for the peer as long
as the gloo group allows instead of giving up at once. ``ficache.sync`` waits
at least ``_MIN_WAIT_S``. Two ranks, rank 1 late by ``LATE_S``; whether the
wait gave up is read from what rank 0 saw (its stall callback ran, or the
wait raised), never from a duration.
"""

from __future__ import annotations

import time
from typing import Any

from ficache._ranks import run_ranks

#: How late rank 1 joins the collective: long enough that a wait that does not
#: give up at once is still waiting when rank 1 arrives.
LATE_S = 3.0
#: Hang guard for the two ranks (never compared with a duration).
HARD_TIMEOUT = 120.0


def exchange_with_no_grace(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 exchanges with ``grace=0``; rank 1 joins ``LATE_S`` later."""
    import torch.distributed as dist

    from ficache.sync import _Channel

    channel = _Channel(dist.group.WORLD, rank, world, 60.0)
    stalled: list[bool] = []
    if rank == 1:
        time.sleep(LATE_S)
    statuses = channel.exchange([rank], 0.0, 60.0, lambda: stalled.append(True))
    return {"stalled": stalled, "statuses": statuses, "error": channel.error}


def wait_past_its_deadline(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 waits on a pending all-gather with a deadline already passed."""
    import torch
    import torch.distributed as dist

    from ficache.sync import _Channel

    channel = _Channel(dist.group.WORLD, rank, world, 60.0)
    out = [torch.zeros(1) for _ in range(world)]
    if rank == 1:
        time.sleep(LATE_S)
    work = dist.all_gather(out, torch.ones(1), async_op=True)
    raised = None
    if rank == 1:  # the late peer: it only completes the collective rank 0 gave up on
        work.wait()
        return {"raised": None, "completed_then": True}
    try:
        channel._wait(work, time.monotonic() - 1.0)
    except TimeoutError as exc:
        raised = str(exc)
    completed_then = work.is_completed()
    work.wait()  # rank 1 arrives: the collective completes, and both ranks leave cleanly
    return {"raised": raised, "completed_then": completed_then}


def test_an_exchange_with_no_grace_releases_at_once() -> None:
    results = run_ranks(exchange_with_no_grace, 2, timeout=HARD_TIMEOUT)
    # Rank 0 gave up on its zero grace before rank 1 came, released, then heard rank 1.
    assert results[0]["stalled"] == [True], results[0]
    assert results[0]["statuses"] == [[0], [1]] and results[0]["error"] is None


def test_a_wait_past_its_deadline_gives_up_at_once() -> None:
    results = run_ranks(wait_past_its_deadline, 2, timeout=HARD_TIMEOUT)
    assert results[0]["completed_then"] is False, results[0]
    assert results[0]["raised"] == (
        "timed out: no answer within the warm start's timeout (60 s)"
    ), results[0]
