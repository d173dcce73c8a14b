"""Run the ficache CLI on a real pseudo-terminal, bounded (shared by the CLI tests).

A test that needs what only a terminal gets (a confirmation prompt, a
progress bar) runs ``python -m ficache`` as a child whose stdin, stdout and
stderr are a pty. Every wait on the child is bounded.
"""

from __future__ import annotations

import os
import pty
import select
import signal
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def run_in_a_terminal(
    args: list[str], answer: bytes | None = None, *, signal_at_prompt: int | None = None
) -> tuple[int, str]:
    """Run ``python -m ficache ARGS`` on a real pseudo-terminal; answer its ``[y/N]`` prompt,
    or send it ``signal_at_prompt`` (SIGINT: the Ctrl-C a user types there) when it asks.

    Hang guard: a child still running 60 s after it started (a changed prompt,
    a child waiting on its terminal) is killed and the test fails with what
    it printed; no wait on the child is unbounded.
    """
    pid, fd = pty.fork()
    if pid == 0:  # the child: stdin, stdout and stderr are the terminal
        try:
            os.chdir(REPO)
            os.execv(sys.executable, [sys.executable, "-m", "ficache", *args])
        finally:
            os._exit(127)  # never return into pytest
    output = b""
    answered = False
    next_signal = 0.0
    deadline = time.monotonic() + 60
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([fd], [], [], 0.2)
            if ready:
                try:
                    chunk = os.read(fd, 4096)
                except OSError:
                    break
                if not chunk:
                    break
                output += chunk
            if signal_at_prompt is not None and b"[y/N]" in output:
                # Again every 0.5 s until it exits: a signal that lands after the
                # prompt is written but before its read() starts only sets Python's
                # flag, and the read then waits (a person presses Ctrl-C again).
                if time.monotonic() >= next_signal:
                    os.kill(pid, signal_at_prompt)
                    next_signal = time.monotonic() + 0.5
            elif not answered and b"[y/N]" in output and answer is not None:
                os.write(fd, answer)
                answered = True
        # The terminal closed (the child exited) or the deadline passed: reap
        # the child, waiting for it only as long as the deadline allows.
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() >= deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                pytest.fail(
                    f"ficache {' '.join(args)} still ran after 60 s on a terminal; killed. "
                    f"It printed: {output.decode(errors='replace')!r}"
                )
            time.sleep(0.05)
    finally:
        os.close(fd)
    return os.waitstatus_to_exitcode(status), output.decode().replace("\r\n", "\n")
