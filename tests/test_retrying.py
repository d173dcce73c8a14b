"""Connection causes and their retry: ``schema.connection_trouble`` and ``ficache.retrying``.

The causes a PostgreSQL server gives (message and SQLSTATE as psycopg reports
them) map to one line naming the cause and its remedy, and to whether trying
again may help; ``retry_transient`` retries only those, within its budget.
The real server's refusals are in ``tests/test_postgres.py`` (restart storms).
"""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy.exc

from ficache import schema
from ficache.errors import RegistryError, RegistryTimeoutError
from ficache.location import resolve
from ficache.retrying import LAST_START, retry_transient

CAUSES = [
    # (driver message, SQLSTATE, transient, words of the line)
    ("FATAL:  sorry, too many clients already", "53300", True, "max_connections"),
    ('FATAL:  too many connections for database "r"', "53300", True, "PgBouncer"),
    ("FATAL:  the database system is starting up", "57P03", True, "starting up"),
    ("FATAL:  the database system is shutting down", "57P03", True, "shutting down"),
    ("FATAL:  terminating connection due to administrator command", "57P01", True, "come back"),
    ("connection refused", None, True, "the connection was refused"),
    ('FATAL:  database "nope" does not exist', "3D000", False, "the URL is right"),
]


@pytest.mark.parametrize(("message", "sqlstate", "transient", "words"), CAUSES)
def test_each_connection_cause_is_named_with_its_remedy(
    message: str, sqlstate: str | None, transient: bool, words: str
) -> None:
    trouble = schema.connection_trouble(message, sqlstate)
    assert trouble is not None
    assert trouble.transient is transient
    assert words in f"{trouble.cause}; {trouble.remedy}"


def translated(orig: BaseException, *, invalidated: bool = False) -> RegistryError:
    """``orig`` as SQLAlchemy raises it from a statement, translated by ficache."""
    wrapped = sqlalchemy.exc.OperationalError(
        "COMMIT", None, orig, connection_invalidated=invalidated
    )
    return schema.translate_operational_error(wrapped, resolve("postgresql+psycopg://h/r"))


def refused_connect(conninfo: str) -> Any:
    """The real error psycopg raises for a connection attempt to ``conninfo`` (it fails)."""
    psycopg = pytest.importorskip("psycopg")
    with pytest.raises(psycopg.OperationalError) as raised:
        psycopg.connect(conninfo, connect_timeout=5)
    return raised.value


@pytest.mark.parametrize(
    ("cls", "message"),
    [
        # psycopg's own errors on a connection it had (no SQLSTATE, no connection attempt),
        # whatever their text: the one the lost-answer adoption test met, and one no list has.
        ("OperationalError", "connection socket closed"),
        ("OperationalError", "a driver message no table lists"),
        ("ConnectionFailure", "08006 by its class"),
        ("ConnectionException", "08000 by its class"),
    ],
)
def test_a_lost_connection_is_recognised_by_its_class_and_asked_again(
    cls: str, message: str
) -> None:
    errors = pytest.importorskip("psycopg.errors")
    error = translated(getattr(errors, cls)(message))
    assert error.transient is True, error
    assert "the connection was reset or dropped" in str(error)
    assert str(error).endswith("; check the server and the network between; retry")


def test_a_connection_sqlalchemy_found_invalidated_is_lost_whatever_its_text() -> None:
    error = translated(Exception("no driver class, no text anyone lists"), invalidated=True)
    assert error.transient is True and "reset or dropped" in str(error)


def test_what_is_not_a_lost_connection_is_not_asked_again() -> None:
    psycopg = pytest.importorskip("psycopg")
    # A connection attempt to a socket that is not there: unreachable, not retried.
    missing = translated(refused_connect("host=/nonexistent-ficache-dir dbname=r"))
    assert missing.transient is False
    assert str(missing).endswith("check that the server runs and the URL is right")
    # The URL's connect timeout is the user's bound on a silent host: not retried.
    assert translated(psycopg.errors.ConnectionTimeout("timed out")).transient is False
    # A refused connection attempt (its cause named from the attempt) is retried.
    refused = translated(refused_connect("host=127.0.0.1 port=1 dbname=r"))
    assert refused.transient is True and "the connection was refused" in str(refused)
    # The server's answer to the work (a SQLSTATE of another class) is no connection cause.
    lock = translated(psycopg.errors.LockNotAvailable("canceling statement due to lock timeout"))
    assert "reset or dropped" not in str(lock)
    # SQLite's errors are never a server's connection.
    busy = translated(sqlite3.OperationalError("database is locked"))
    assert "reset or dropped" not in str(busy) and "cannot reach" not in str(busy)


def refusing(times: int, error: RegistryError) -> tuple[list[float], object]:
    calls: list[float] = []

    def attempt() -> str:
        calls.append(time.monotonic())
        if len(calls) <= times:
            raise error
        return "served"

    return calls, attempt


def transient_error() -> RegistryError:
    error = RegistryError("cannot reach registry r (too many clients)")
    error.transient = True
    return error


def test_a_transient_refusal_is_retried_until_served() -> None:
    calls, attempt = refusing(3, transient_error())
    assert retry_transient(attempt, within=10) == "served"  # type: ignore[arg-type]
    assert len(calls) == 4


def test_a_refusal_that_stays_gives_up_within_the_budget_and_says_so() -> None:
    calls, attempt = refusing(10**6, transient_error())
    started = time.monotonic()
    with pytest.raises(RegistryError, match=r"still refused after \d+ attempt\(s\) over"):
        retry_transient(attempt, within=1.0)  # type: ignore[arg-type]
    assert len(calls) > 1
    assert calls[-1] - started <= LAST_START * 1.0 + 0.05
    assert time.monotonic() - started < 1.0


def test_what_is_not_transient_leaves_at_once() -> None:
    for error in (RegistryError("registry r is corrupt"), RegistryTimeoutError("cut")):
        calls, attempt = refusing(1, error)
        with pytest.raises(type(error)):
            retry_transient(attempt, within=10)  # type: ignore[arg-type]
        assert len(calls) == 1


def test_the_backoff_is_jittered_below_a_ceiling_that_doubles_up_to_its_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The delays between attempts, recorded (instrumentation: ``time.sleep`` as
    ``ficache.retrying`` calls it, recorded instead of slept): each below its attempt's
    ceiling (``FIRST_DELAY_S`` doubling up to ``MAX_DELAY_S``) and spread under it, so
    servers refused together do not come back together."""
    import random

    from ficache import retrying

    slept: list[float] = []
    monkeypatch.setattr(retrying.time, "sleep", slept.append)
    random.seed(36)
    refusals = 9
    runs = 200
    by_attempt: list[list[float]] = [[] for _ in range(refusals)]
    for _ in range(runs):
        slept.clear()
        _calls, attempt = refusing(refusals, transient_error())
        assert retry_transient(attempt, within=1000) == "served"  # type: ignore[arg-type]
        assert len(slept) == refusals
        for n, delay in enumerate(slept):
            by_attempt[n].append(delay)
    ceilings = [min(retrying.FIRST_DELAY_S * 2**n, retrying.MAX_DELAY_S) for n in range(refusals)]
    assert ceilings[-1] == retrying.MAX_DELAY_S and ceilings[0] == retrying.FIRST_DELAY_S
    for ceiling, delays in zip(ceilings, by_attempt, strict=True):
        assert all(0.0 <= d <= ceiling for d in delays), (ceiling, max(delays))
        # Spread over the whole range under the ceiling, not one value (200 uniform draws).
        assert min(delays) < 0.1 * ceiling and max(delays) > 0.9 * ceiling, (ceiling, delays)
        assert len(set(delays)) == runs


def test_a_start_whose_commit_breaks_a_constraint_fails_at_once_not_retried(
    registry_path: Path, autotuner: Any
) -> None:
    """Through the retrying path a warm start's commit takes (``retry_transient`` around
    ``Registry.write``), at the default registry timeout: a constraint the commit breaks
    (a unique index on commits' kind, added for the test, so a second startup commit breaks
    it) fails on the first attempt. Retried, it would hold the start about 48 s."""
    import ficache
    from ficache.deadline import DEFAULT_REGISTRY_TIMEOUT_S
    from ficache.standin import standin_tune

    db = str(registry_path)
    with ficache.warm_start(db=db) as cold:
        standin_tune()
    assert cold.report.committed == 18
    with sqlite3.connect(db) as conn:
        conn.execute("CREATE UNIQUE INDEX one_commit_per_kind ON commits (kind)")
    conn.close()

    started = time.monotonic()
    with ficache.warm_start(db=db) as ws:  # the default registry timeout
        assert standin_tune(shapes=[(512, 512)]).profiled == 6
    elapsed = time.monotonic() - started

    report = ws.report
    assert report.reason is not None and report.committed == 0, report
    assert f"registry {db} refused the write (" in report.reason, report.reason
    assert "still refused after" not in report.reason, report.reason  # one attempt
    assert "\n" not in report.reason
    with sqlite3.connect(f"file:{db}?mode=ro", uri=True) as conn:
        assert conn.execute("SELECT count(*) FROM commits").fetchone() == (1,)
    conn.close()
    # A bound on a failure, far below what retrying it would cost (0.8 x the default).
    assert elapsed < DEFAULT_REGISTRY_TIMEOUT_S * LAST_START / 2, elapsed
