"""A client-side deadline for work on a PostgreSQL registry: a frozen server ends in an error.

A PostgreSQL server that stops answering without closing its connections
(its processes stopped or swapped out, its host hung, a network path that
drops only the replies) leaves a client blocked in a read for ever. Nothing
on the server side can end that wait: ``statement_timeout`` and
``lock_timeout`` are enforced by the server that no longer runs, and while the
server's kernel still acknowledges TCP, neither keepalives nor
``tcp_user_timeout`` fire. A warm start blocked this way on rank 0 would hold
every rank of its group at the next collective for the group's whole
timeout (30 minutes by default).

``registry_deadline(seconds, what)`` bounds such work from the client. While
it is active on a thread, every connection that one of ficache's PostgreSQL
engines (``watch_engine``, called by ``ficache.schema.make_engine``) opens or
hands out on that thread is watched. When the deadline passes, a timer
thread shuts the watched sockets down (``shutdown(2)``), which wakes a
blocked read at once with "server closed the connection", and the block's
exception leaves as ``RegistryTimeoutError``, one line naming ``what``, the
limit and the time the block actually ran before its exception left (what
happened, not only what was configured).

Invariants:
- Only this thread's watched connections are touched, and only after the
  deadline: a block that ends in time is left exactly as it ran, and the
  timer is cancelled on exit.
- A watched connection is shut down through a duplicate of its descriptor
  taken when it was first watched, so a descriptor the driver closed and the
  process reused for something else (a gloo socket, a file) is never hit.
  The duplicate is closed when the pool closes the connection or the block
  ends, whichever comes first.
- A write cut off by the deadline is atomic like any other: the server rolls
  back a transaction whose connection is gone before its COMMIT arrived. A
  COMMIT the server had already received may still land: the caller must
  treat the outcome of a cut write as unknown (``warm_start`` reports it so).
- SQLite registries are not watched: a local file does not freeze this way,
  its lock waits are bounded by ``busy_timeout``, and a read blocked in the
  kernel (a hung network file system) cannot be interrupted from user space.
- Connections are seen when they connect or are checked out. A pooled
  connection's pre-ping runs before its checkout is seen, so bound work on a
  registry opened inside the deadline, as ``warm_start`` does.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

from .errors import RegistryTimeoutError

#: How long a server start waits on a registry server that stopped answering, per
#: phase (rank 0's export, its commit, the vLLM plugin's adoption): above the worst
#: legitimate commit (4 attempts, each waiting up to a 5 s busy timeout for the lock),
#: far below a process group's own timeout (30 minutes by default).
DEFAULT_REGISTRY_TIMEOUT_S = 60.0

_local = threading.local()


class _Watch:
    """The connections one deadline watches, and whether it has fired."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.sockets: dict[int, socket.socket] = {}  # id(dbapi connection) -> duplicate
        self.fired = False

    def add(self, dbapi_connection: Any) -> None:
        key = id(dbapi_connection)
        with self.lock:
            if key in self.sockets:
                return
            try:
                fd = dbapi_connection.pgconn.socket
                duplicate = socket.socket(fileno=os.dup(fd))
            except Exception:  # noqa: BLE001 - not a live psycopg connection: nothing to cut
                return
            if self.fired:  # connected after the deadline passed: cut it at once
                _cut(duplicate)
            self.sockets[key] = duplicate

    def forget(self, dbapi_connection: Any) -> None:
        with self.lock:
            duplicate = self.sockets.pop(id(dbapi_connection), None)
        if duplicate is not None:
            duplicate.close()

    def fire(self) -> None:
        with self.lock:
            self.fired = True
            for duplicate in self.sockets.values():
                _cut(duplicate)

    def close(self) -> None:
        with self.lock:
            sockets, self.sockets = list(self.sockets.values()), {}
        for duplicate in sockets:
            duplicate.close()


def _cut(duplicate: socket.socket) -> None:
    with contextlib.suppress(OSError):  # already shut down or reset by the peer
        duplicate.shutdown(socket.SHUT_RDWR)


def _current() -> _Watch | None:
    return getattr(_local, "watch", None)


def watch_engine(engine: Engine) -> None:
    """Let ``registry_deadline`` watch the connections of ``engine`` (PostgreSQL)."""
    from sqlalchemy import event  # lazy: a start's non-zero ranks never import SQLAlchemy

    def seen(dbapi_connection: Any, *_args: Any) -> None:
        watch = _current()
        if watch is not None:
            watch.add(dbapi_connection)

    def closed(dbapi_connection: Any, *_args: Any) -> None:
        watch = _current()
        if watch is not None:
            watch.forget(dbapi_connection)

    event.listen(engine, "connect", seen)
    event.listen(engine, "checkout", seen)
    event.listen(engine, "close", closed)
    event.listen(engine, "close_detached", closed)


@contextlib.contextmanager
def registry_deadline(seconds: float | None, what: str) -> Iterator[None]:
    """Bound this thread's work on PostgreSQL registries in the block to ``seconds``.

    ``None`` sets no deadline. ``what`` completes "{what} did not answer
    within N s" (``"registry postgresql://host/db"``, say). Deadlines do not
    nest: an inner one replaces the outer one for its block.
    """
    if seconds is None:
        yield
        return
    watch = _Watch()
    outer = _current()
    timer = threading.Timer(max(seconds, 0.0), watch.fire)
    timer.daemon = True
    _local.watch = watch
    started = time.monotonic()
    timer.start()
    try:
        yield
    except Exception as exc:
        if watch.fired:
            elapsed = time.monotonic() - started
            raise RegistryTimeoutError(
                f"{what} did not answer within {seconds:g} s, so its connection was cut "
                f"after {elapsed:.1f} s: "
                "check that the server is running and reachable, or raise the limit"
            ) from exc
        raise
    finally:
        timer.cancel()
        _local.watch = outer
        watch.close()
