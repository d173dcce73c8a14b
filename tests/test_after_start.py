"""``ficache.after_start``: work a start leaves running, in order, waited for, fork-safe.

Plain threads and a real ``os.fork``; the work is test functions that record
what ran (the served mark itself is tested in ``tests/test_usage.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time

from ficache import after_start


def test_work_runs_in_submission_order_and_a_failure_does_not_stop_the_next() -> None:
    gate = threading.Event()
    ran: list[str] = []

    def first() -> None:
        assert gate.wait(timeout=120)
        ran.append("first")

    def failing() -> None:
        ran.append("failing")
        raise RuntimeError("this work fails")

    after_start.submit("first", first)
    after_start.submit("failing", failing)
    after_start.submit("last", ran.append, "last")

    assert after_start.wait(timeout=0) is False  # the first one is held at its gate
    assert ran == []  # nothing overtook it
    gate.set()
    assert after_start.wait(timeout=120) is True
    assert ran == ["first", "failing", "last"]


def test_a_forked_child_has_nothing_pending_from_its_parent() -> None:
    """Forked while a submission held the module's lock (here the test holds it, as a
    ``submit`` on another thread would at that instant) and with work still running: the
    child neither waits for its parent's thread nor deadlocks on the copied lock."""
    gate = threading.Event()
    after_start.submit("held", gate.wait, 120)
    try:
        with after_start._PENDING.lock:
            pid = os.fork()
            if pid == 0:  # the child: the lock was taken at the fork; the thread is not here
                os._exit(0 if after_start.wait(timeout=5) else 1)
        deadline = time.monotonic() + 60
        while (done := os.waitpid(pid, os.WNOHANG)) == (0, 0) and time.monotonic() < deadline:
            time.sleep(0.05)
        if done == (0, 0):
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError("the forked child hung in after_start.wait")
        assert os.waitstatus_to_exitcode(done[1]) == 0
        assert after_start.wait(timeout=0) is False  # the parent's is still held
    finally:
        gate.set()
    assert after_start.wait(timeout=120) is True
