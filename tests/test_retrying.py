"""Connection causes and their retry: ``schema.connection_trouble`` and ``ficache.retrying``.

The causes a PostgreSQL server gives (message and SQLSTATE as psycopg reports
them) map to one line naming the cause and its remedy, and to whether trying
again may help; ``retry_transient`` retries only those, within its budget.
The real server's refusals are in ``tests/test_postgres.py`` (restart storms).
"""

from __future__ import annotations

import time

import pytest

from ficache import schema
from ficache.errors import RegistryError, RegistryTimeoutError
from ficache.retrying import LAST_START, retry_transient

CAUSES = [
    # (driver message, SQLSTATE, transient, words of the line)
    ("FATAL:  sorry, too many clients already", "53300", True, "max_connections"),
    ('FATAL:  too many connections for database "r"', "53300", True, "PgBouncer"),
    ("FATAL:  the database system is starting up", "57P03", True, "starting up"),
    ("FATAL:  the database system is shutting down", "57P03", True, "shutting down"),
    ("FATAL:  terminating connection due to administrator command", "57P01", True, "come back"),
    ("connection refused", None, True, "the connection was refused"),
    ("server closed the connection unexpectedly", None, True, "reset or dropped"),
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
