"""Retrying registry work that a server refused for now, within the start's registry deadline.

A fleet restarting at once (a rollout, a node pool coming back) meets a
registry server that refuses some of its connections for a moment: all its
connection slots taken ("too many clients"), the server starting up or
shutting down, a connection refused or reset, a serialization failure.
``retry_transient(attempt, within=...)`` runs ``attempt`` again after such a
refusal, with jittered exponential backoff, until it succeeds, fails for a
reason that is not transient, or the time ``within`` (the caller's
``registry_timeout``) would pass; then the last error is raised, saying how
many attempts were made over how long.

Invariants:
- Only errors ``ficache.schema.translate_operational_error`` marked
  ``transient`` are retried; every other exception leaves at once, unchanged.
  A ``RegistryTimeoutError`` (the deadline cut a frozen server) is never
  transient.
- No attempt starts after ``within`` x ``LAST_START`` seconds from the first:
  the last attempt has the rest of the limit to finish, so the caller's
  ``registry_deadline`` over the same limit cuts only a server that froze.
- The backoff is "full jitter" (a uniform draw below a doubling ceiling, from
  ``FIRST_DELAY_S`` up to ``MAX_DELAY_S``), so servers refused together do
  not come back together.
- An attempt must be safe to run again after a failure: a read is; a write
  must be idempotent or check, before it runs again, whether the failed
  attempt landed (``before_retry``, or, as the warm start's commit does,
  ``Registry.write(once_token=...)``, which checks under the write lock).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import TypeVar

from ficache.deadline import DEFAULT_REGISTRY_TIMEOUT_S
from ficache.errors import FicacheError

T = TypeVar("T")

#: The first backoff ceiling, and the largest: a refused server is asked again within
#: a second, and a storm of clients spreads its retries over that second.
FIRST_DELAY_S = 0.05
MAX_DELAY_S = 1.0
#: No attempt starts after this fraction of ``within``.
LAST_START = 0.8


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is a refusal the same work may get past by trying again."""
    return isinstance(exc, FicacheError) and exc.transient


def retry_transient(
    attempt: Callable[[], T],
    *,
    within: float | None,
    before_retry: Callable[[], T | None] | None = None,
) -> T:
    """``attempt()``, tried again after transient refusals for up to ``within`` seconds.

    ``within`` None means the default registry timeout. ``before_retry``, when
    given, runs before each further attempt: a value other than None is the
    result (the failed attempt had landed after all) and ends the retries; a
    transient error in it counts as one more refused attempt.
    """
    budget = DEFAULT_REGISTRY_TIMEOUT_S if within is None else max(within, 0.0)
    started = time.monotonic()
    ceiling = FIRST_DELAY_S
    attempts = 0
    while True:
        attempts += 1
        try:
            if attempts > 1 and before_retry is not None:
                landed = before_retry()
                if landed is not None:
                    return landed
            return attempt()
        except FicacheError as exc:
            if not exc.transient:
                raise
            delay = random.uniform(0.0, ceiling)
            ceiling = min(ceiling * 2, MAX_DELAY_S)
            waited = time.monotonic() - started
            if waited + delay > budget * LAST_START:
                raise type(exc)(_gave_up(str(exc), attempts, waited, budget, exc)) from exc
            time.sleep(delay)


def _gave_up(message: str, attempts: int, waited: float, budget: float, exc: FicacheError) -> str:
    """``message`` with the attempts made, placed before its remedy, which stays last."""
    tried = (
        f"still refused after {attempts} attempt(s) over {waited:.1f} s "
        f"(registry timeout {budget:g} s)"
    )
    remedy = getattr(exc, "remedy", None)
    if remedy and message.endswith(f"; {remedy}"):
        return f"{message[: -len(remedy) - 2]}; {tried}; {remedy}"
    return f"{message}; {tried}"
