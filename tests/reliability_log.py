"""Figures the reliability tests measured, for RELIABILITY.md.

A reliability test (crashes, full disks, fuzzing, killed ranks, the soak...)
calls :func:`record` once per case with what it applied and what it
measured. When ``FICACHE_RELIABILITY_LOG`` names a file, each call appends
one JSON line to it; otherwise :func:`record` does nothing, so a test never
depends on it. ``benchmarks/reliability.py`` sets the variable, runs the
tests and renders the table from the lines.

Invariants:
- One call, one line: the file is opened in append mode and the line is
  written whole under an exclusive ``flock``, so concurrent tests (and
  their child processes) never interleave lines.
- A line is ``{"item": ..., "test": ..., "backend": ..., "applied": ...,
  "outcome": ..., "ok": bool, "figures": {...}}``; ``figures`` holds plain
  JSON numbers and strings only.
"""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping

LOG_ENV = "FICACHE_RELIABILITY_LOG"


def record(
    *,
    item: str,
    test: str,
    applied: str,
    outcome: str,
    ok: bool,
    backend: str = "sqlite",
    figures: Mapping[str, int | float | str] | None = None,
) -> None:
    """Append one measured case to the reliability log, if one is set.

    ``item`` names the reliability item (e.g. ``"crash safety"``), ``test``
    the pytest node or case, ``applied`` the load or faults applied in words
    (``"60 SIGKILLs"``), ``outcome`` what was measured in words (``"60/60
    verify clean"``), ``ok`` whether the case met its expectation.
    """
    path = os.environ.get(LOG_ENV)
    if not path:
        return
    line = json.dumps(
        {
            "item": item,
            "test": test,
            "backend": backend,
            "applied": applied,
            "outcome": outcome,
            "ok": bool(ok),
            "figures": dict(figures or {}),
        },
        sort_keys=True,
    )
    with open(path, "a", encoding="utf-8") as log:
        fcntl.flock(log, fcntl.LOCK_EX)
        try:
            log.write(line + "\n")
            log.flush()
        finally:
            fcntl.flock(log, fcntl.LOCK_UN)
