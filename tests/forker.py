"""The forker: real processes that start in milliseconds, for tests that kill or load them.

An interpreter start with torch costs ~8 s here, a fork ~10 ms. ``Forker``
starts one long-lived process that imports torch, FlashInfer and ficache
once, then forks one child per request; each child is a real process
running the real CLI (``ficache.cli.main``), ``Registry.open``,
``ficache.warm_start`` with the CPU stand-in (``ficache.standin``), or a
function of a module under ``tests/`` (op ``call``: ``["module:function",
*args]``, its return value the exit code; the soak's workers run so).

The child reports its progress as marker lines on a FIFO: ``start``,
``pre`` (just before a registry write transaction begins: it wraps
``ficache.schema.write_transaction``, the one path of every write, and only
observes it; not for ``call``), ``begin`` (the transaction holds the write
lock), ``committed`` (it has committed) and ``done``.

Invariants:
- One child at a time: the forker answers ``pid N`` when it forked and
  ``exit CODE`` when the child has gone; it forks the next one only then.
- Every wait has a hard deadline (``CHILD_DEADLINE_S``, or the one a
  ``spawn`` gives), past which the child (and if need be the forker) is
  killed and the test fails.

Used by ``tests/test_crash.py`` (SIGKILL at random moments) and
``tests/test_soak.py`` (many processes under sustained load).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from ficache import schema
from ficache.fingerprint import Fingerprint

REPO = Path(__file__).resolve().parent.parent
#: Hard limits: the forker's start (imports torch and FlashInfer), one child's run.
FORKER_START_S = 300.0
CHILD_DEADLINE_S = 120.0

# Imports once, then forks one child per request line (JSON) on stdin and
# answers "pid N" at once and "exit CODE" when the child has gone.
_FORKER = r"""
import contextlib, importlib, json, os, sys, time, traceback
sys.path.insert(0, os.path.join(os.getcwd(), "tests"))  # the modules op "call" runs
import torch
torch.set_num_threads(1)  # no OpenMP worker threads in this process: safe to fork
torch.ones(2, 2) @ torch.ones(2, 2)  # torch's lazy set-up, once, before any fork
import flashinfer.autotuner
import ficache, ficache.bundle, ficache.cli, ficache.merge, ficache.standin, ficache.sync, ficache.usage
from ficache import schema
from ficache.fingerprint import collect
from ficache.registry import Registry


def mark(fd, name):
    os.write(fd, f"{name} {time.monotonic()!r}\n".encode())


def observe_write_transactions(fd):
    real = schema.write_transaction

    @contextlib.contextmanager
    def observed(engine):
        mark(fd, "pre")
        with real(engine) as conn:
            mark(fd, "begin")
            yield conn
        mark(fd, "committed")

    schema.write_transaction = observed


def run(op, args):
    if op == "cli":
        try:
            ficache.cli.main(args)
        except SystemExit as exc:
            return exc.code if isinstance(exc.code, int) else 1
        return 0
    if op == "open":
        Registry.open(args[0]).close()
        return 0
    if op == "warm_start":
        with ficache.warm_start(None, db=args[0]) as ws:
            ficache.standin.standin_tune(force_tactic=1)
        # This child ends with os._exit, which joins no thread: wait for the served mark as
        # the interpreter's shutdown would.
        ficache.usage.wait_for_served_marks()
        print(json.dumps(ws.report.as_json()))
        return 0 if ws.report.commit_id is not None else 3
    if op == "fingerprint":
        print(json.dumps(collect().as_dict()))
        return 0
    if op == "call":
        module, _, name = args[0].partition(":")
        return getattr(importlib.import_module(module), name)(*args[1:])
    raise ValueError(f"unknown op {op!r}")


def child(request):
    log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    os.environ.update(request["env"])
    fd = os.open(request["fifo"], os.O_WRONLY)
    if request["op"] != "call":
        observe_write_transactions(fd)
    mark(fd, "start")
    code = run(request["op"], request["args"])
    mark(fd, "done")
    return code


print("ready", flush=True)
for line in sys.stdin:
    request = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 70
        try:
            code = child(request)
        except BaseException:
            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(code)
    print(f"pid {pid}", flush=True)
    _, status = os.waitpid(pid, 0)
    print(f"exit {os.waitstatus_to_exitcode(status)}", flush=True)
"""


class _Lines:
    """Lines read from a raw file descriptor, as they come."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.buffer = b""
        self.eof = False

    def read(self) -> list[str]:
        try:
            data = os.read(self.fd, 65536)
        except BlockingIOError:  # a non-blocking FIFO whose writer is still there
            return []
        if not data:
            self.eof = True
            return []
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        return [line.decode() for line in lines]


class Forker:
    """The long-lived process the children are forked from (see ``_FORKER``)."""

    def __init__(self, workdir: Path) -> None:
        self.workdir = workdir
        self.runs = 0
        env = {k: v for k, v in os.environ.items() if k != schema.ENV_VAR}
        env["XDG_CACHE_HOME"] = str(workdir / "user-cache")
        self.stderr = (workdir / "forker.log").open("wb")
        self.proc = subprocess.Popen(
            [sys.executable, "-c", _FORKER],
            cwd=REPO,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self.stderr,
        )
        assert self.proc.stdout is not None
        self.out = _Lines(self.proc.stdout.fileno())
        self.pending: list[str] = []
        self.current_fingerprint: Fingerprint | None = None
        if self.line(time.monotonic() + FORKER_START_S) != "ready":
            self.fail("the forker did not start")

    def read(self) -> None:
        """Take in what the forker wrote (call when its stdout is readable)."""
        self.pending.extend(self.out.read())
        if self.out.eof and not self.pending:
            self.fail("the forker died")

    def line(self, deadline: float) -> str | None:
        """The forker's next line, or None at ``deadline``."""
        while not self.pending:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([self.out.fd], [], [], left)
            if ready:
                self.read()
        return self.pending.pop(0)

    def fail(self, message: str) -> None:
        self.stop()
        log = (self.workdir / "forker.log").read_text(errors="replace")[-3000:]
        pytest.fail(f"{message}; forker log:\n{log}")

    def spawn(
        self,
        op: str,
        args: list[str],
        env: dict[str, str] | None = None,
        deadline_s: float = CHILD_DEADLINE_S,
    ) -> Child:
        if self.proc.poll() is not None:
            pytest.fail("the forker is gone (stopped by an earlier failure; see that one)")
        self.runs += 1
        fifo = self.workdir / f"markers-{self.runs}.fifo"
        log = self.workdir / f"child-{self.runs}.log"
        os.mkfifo(fifo)
        fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
        request = {"op": op, "args": args, "env": env or {}, "fifo": str(fifo), "log": str(log)}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request).encode() + b"\n")
        self.proc.stdin.flush()
        answer = self.line(time.monotonic() + CHILD_DEADLINE_S)
        if answer is None or not answer.startswith("pid "):
            os.close(fd)
            self.fail(f"the forker answered {answer!r} to {op} {args}")
        assert answer is not None
        return Child(self, int(answer.split()[1]), _Lines(fd), log, fifo, limit_s=deadline_s)

    def fingerprint(self) -> Fingerprint:
        """This environment's fingerprint, as the children's warm starts collect it."""
        if self.current_fingerprint is None:
            child = self.spawn("fingerprint", [])
            code = child.reap()
            output = child.log.read_text()
            assert code == 0, output
            [line] = [line for line in output.splitlines() if line.startswith('{"')]
            self.current_fingerprint = Fingerprint(**json.loads(line))
        return self.current_fingerprint

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.communicate(timeout=30)
        self.stderr.close()


@dataclass
class Child:
    """One forked child: the markers it wrote (name -> monotonic time) and its exit code."""

    forker: Forker
    pid: int
    fifo: _Lines
    log: Path
    fifo_path: Path
    markers: dict[str, float] = field(default_factory=dict)
    exit_code: int | None = None
    limit_s: float = CHILD_DEADLINE_S  # its hard deadline, from its spawn
    deadline: float = field(init=False)

    def __post_init__(self) -> None:
        self.deadline = time.monotonic() + self.limit_s

    def _take(self, lines: list[str]) -> None:
        for line in lines:
            name, at = line.split()
            self.markers.setdefault(name, float(at))

    def _pump(self, timeout: float) -> None:
        """Take in what the child and the forker wrote, waiting at most ``timeout``."""
        if self.exit_code is None and self.forker.pending:
            self._answer(self.forker.pending.pop(0))
        if self.exit_code is not None:
            # It has ended: everything it wrote is in the FIFO already.
            while not self.fifo.eof:
                lines = self.fifo.read()
                if not lines and not self.fifo.eof:
                    break  # a process it forked still holds the FIFO: take what is there
                self._take(lines)
            return
        fds = [self.forker.out.fd] + ([] if self.fifo.eof else [self.fifo.fd])
        ready, _, _ = select.select(fds, [], [], max(timeout, 0.0))
        if self.fifo.fd in ready:
            self._take(self.fifo.read())
        if self.forker.out.fd in ready:
            self.forker.read()
            if self.forker.pending:
                self._answer(self.forker.pending.pop(0))
                self._pump(0.0)

    def _answer(self, line: str) -> None:
        if not line.startswith("exit "):
            self.forker.fail(f"the forker answered {line!r}")
        self.exit_code = int(line.split()[1])

    def _past_deadline(self, what: str) -> None:
        if time.monotonic() < self.deadline:
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        self.forker.fail(f"child {self.pid} still ran {what} after {self.limit_s:g} s; killed")

    def wait_for(self, marker: str) -> float | None:
        """When the child wrote ``marker``; None when it ended without it."""
        while marker not in self.markers and self.exit_code is None:
            self._past_deadline(f"waiting for {marker!r}")
            self._pump(self.deadline - time.monotonic())
        return self.markers.get(marker)

    def sleep_until(self, moment: float) -> None:
        """Wait until the monotonic ``moment``, taking in markers meanwhile."""
        while self.exit_code is None and time.monotonic() < moment:
            self._pump(moment - time.monotonic())

    def kill(self) -> None:
        self._pump(0.0)  # an exit already reported: nothing to kill
        if self.exit_code is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)

    def reap(self) -> int:
        """Wait for the child's end (its markers all taken in); its exit code."""
        while self.exit_code is None:
            self._past_deadline("at its end")
            self._pump(self.deadline - time.monotonic())
        self._pump(0.0)
        os.close(self.fifo.fd)
        self.fifo_path.unlink()
        return self.exit_code

    @property
    def phase(self) -> str:
        if "committed" in self.markers:
            return "after"
        return "during" if "begin" in self.markers else "before"
