"""Work a start leaves for after it has returned: run on threads of their own, in order.

A warm start's last write that nobody waits for (the served mark of a SQLite
registry, ``ficache.usage.mark_served_after_start``) is handed here, so no
rank waits for its disk writes.

Invariants:
- ``submit`` returns at once and never raises (a thread that cannot be
  started drops the work, logged at debug level: it is work that may be
  skipped).
- Work runs in the order it was submitted: each thread first waits for the
  one submitted before it.
- Nothing is dropped at a normal exit: the threads are not daemons, so the
  interpreter's shutdown (a ``multiprocessing`` child's too) waits for them.
  A process that ends without that shutdown (``os._exit``, a kill) loses
  what had not finished.
- ``wait`` returns once everything submitted before the call is done;
  ``Registry.open`` calls it, so whatever a process reads through a registry
  shows the work its own starts left.
- A forked child starts with nothing pending (the parent's threads do not
  exist in it).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

logger = logging.getLogger(__name__)


class _Pending:
    """The threads started by ``submit`` that have not finished, oldest first."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.threads: list[threading.Thread] = []

    def start(self, what: str, work: Callable[..., Any], args: tuple[Any, ...]) -> None:
        with self.lock:
            previous = self.threads[-1] if self.threads else None
            thread = threading.Thread(
                target=self._run,
                args=(previous, what, work, args),
                name=f"ficache-{what}",
                daemon=False,  # joined at the interpreter's shutdown: nothing is dropped
            )
            self.threads.append(thread)
            try:
                thread.start()
            except BaseException:
                self.threads.remove(thread)
                raise

    def _run(
        self,
        previous: threading.Thread | None,
        what: str,
        work: Callable[..., Any],
        args: tuple[Any, ...],
    ) -> None:
        try:
            if previous is not None:
                previous.join()  # in the order of submission
            work(*args)
        except Exception as exc:  # noqa: BLE001 - work submitted here may be skipped
            logger.debug("ficache: %s after the start failed: %s", what, exc)
        finally:
            with self.lock:
                if threading.current_thread() in self.threads:
                    self.threads.remove(threading.current_thread())

    def wait(self, timeout: float | None) -> bool:
        deadline = None if timeout is None else time.monotonic() + timeout
        with self.lock:
            pending = [t for t in self.threads if t is not threading.current_thread()]
        for thread in pending:
            thread.join(None if deadline is None else max(deadline - time.monotonic(), 0.0))
        return not any(t.is_alive() for t in pending)

    def forget_after_fork(self) -> None:
        """In a forked child: the parent's threads do not exist here, and the lock may
        have been held by one of them at the fork."""
        self.lock = threading.Lock()
        self.threads = []


_PENDING = _Pending()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_PENDING.forget_after_fork)


def submit(what: str, work: Callable[..., Any], *args: Any) -> None:
    """Run ``work(*args)`` on a thread of its own, after everything submitted before it;
    ``what`` names it in the thread's name and in the log. Returns at once, never raises."""
    try:
        _PENDING.start(what, work, args)
    except Exception as exc:  # noqa: BLE001 - no thread (a process at its limit): skipped
        logger.debug("ficache: %s after the start skipped: %s", what, exc)


def wait(timeout: float | None = None) -> bool:
    """Wait until everything submitted before this call is done (at most ``timeout``
    seconds); True when nothing of it is left running."""
    return _PENDING.wait(timeout)
