"""Hold SIGINT and SIGTERM across the end of a commit, so a commit made is a commit known.

``Registry.transaction`` calls ``held.start()`` as the last step inside its
transaction; from there until the ``with`` block ends (the database's
COMMIT, then the registry telling its listeners the commit id) a Ctrl-C
stays pending instead of raising ``KeyboardInterrupt`` halfway. It is
delivered when the block ends, by which time the caller can know the
commit landed (``Registry.commit_listeners``) and say so: the CLI then
reports the commit as made instead of "interrupted".

Invariants:
- Only SIGINT and SIGTERM (the CLI's stop signals), only in the calling
  thread, only between ``start()`` and the
  end of the block; the thread's previous signal mask is restored on every
  exit, also on exceptions, and a pending signal is delivered then.
- Where signal masks do not exist (Windows), it does nothing.
"""

from __future__ import annotations

import signal
from types import TracebackType

_CAN_MASK = hasattr(signal, "pthread_sigmask")
#: The signals held: Ctrl-C, and SIGTERM, which the CLI treats as one.
_HELD = {signal.SIGINT, signal.SIGTERM}


class HeldInterrupts:
    """``with HeldInterrupts() as held: ...; held.start(); ...``: SIGINT/SIGTERM wait from start()."""

    def __init__(self) -> None:
        self._previous: set[int | signal.Signals] | None = None

    def start(self) -> None:
        if _CAN_MASK and self._previous is None:
            self._previous = set(signal.pthread_sigmask(signal.SIG_BLOCK, _HELD))

    def __enter__(self) -> HeldInterrupts:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._previous is not None:
            previous, self._previous = self._previous, None
            signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def interrupt_pending() -> bool:
    """True when a SIGINT or SIGTERM waits, held (always False where masks do not exist)."""
    return _CAN_MASK and bool(_HELD & signal.sigpending())
