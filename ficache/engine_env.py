"""What the engine plugins (vLLM, SGLang) share: the environment they read, their
start-up adoption and their one log line per start, each written once.

Every engine plugin calls these functions rather than reading the variables
itself, so one variable means one thing whichever engine runs the start, and
the plugins differ only in how they hook their engine (``adopt_at_start``,
``log_report``).

- ``FICACHE_<ENGINE>`` / ``FICACHE_ADOPT`` (``switch``): on unless ``0``,
  ``false``, ``off``, ``no`` or ``n``; a value that is neither on nor off is
  one warning and on.
- ``FICACHE_REGISTRY_TIMEOUT`` (``registry_timeout``): seconds a start waits,
  per phase, on a registry server that stopped answering (default 60).
- ``FICACHE_MODE`` (``start_mode``): how a start uses the registry. ``tune``
  (the default): serve the registry, let FlashInfer profile what is missing,
  commit it. ``replay``: serve the registry and never profile; a key the
  registry lacks runs FlashInfer's fallback tactic and is counted in the
  start's report (``missed``); nothing is committed (``ficache.warm_start``'s
  ``mode``).

Invariants: these functions never raise and import nothing heavy (they run in
an engine's plugin hook, before any collective). A value they cannot read is
one warning per process and per variable, and the default: a typo never stops
a server, and every rank of a server reads the same environment.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable
from typing import Any

logger = logging.getLogger("ficache.engine")

ENV_MODE = "FICACHE_MODE"
ENV_ADOPT = "FICACHE_ADOPT"
ENV_REGISTRY_TIMEOUT = "FICACHE_REGISTRY_TIMEOUT"
#: The modes a warm start knows (``ficache.sync.MODES`` is this tuple).
MODES: tuple[str, ...] = ("tune", "replay")
DEFAULT_MODE = "tune"

_warned: set[str] = set()
_lock = threading.Lock()


def _warn_once(key: str, message: str) -> None:
    with _lock:
        if key in _warned:
            return
        _warned.add(key)
    logger.warning(message)


def start_mode() -> str:
    """``FICACHE_MODE``: ``"tune"`` (unset or empty) or ``"replay"``, case-insensitive.

    Any other value is one warning (once per process) and ``"tune"``.
    """
    raw = os.environ.get(ENV_MODE, "")
    mode = raw.strip().lower()
    if not mode:
        return DEFAULT_MODE
    if mode in MODES:
        return mode
    _warn_once(
        ENV_MODE,
        f"ficache: {ENV_MODE}={raw!r} is not one of {', '.join(MODES)}; "
        f"starting in {DEFAULT_MODE} mode",
    )
    return DEFAULT_MODE


#: The spellings of an on/off variable, case-insensitive, surrounding spaces ignored.
SWITCH_ON: tuple[str, ...] = ("1", "true", "on", "yes", "y")
SWITCH_OFF: tuple[str, ...] = ("0", "false", "off", "no", "n")


def switch(name: str, warn_once: Callable[[str, str], None] = _warn_once) -> bool:
    """An on/off variable, on by default (unset or empty).

    On for ``1``, ``true``, ``on``, ``yes``, ``y``; off for ``0``, ``false``,
    ``off``, ``no``, ``n``. Any other value is one warning per process and per
    variable, and the default (on): a typo never turns a plugin off, and never
    leaves an operator believing it did without saying so.
    """
    raw = os.environ.get(name, "")
    value = raw.strip().lower()
    if not value or value in SWITCH_ON:
        return True
    if value in SWITCH_OFF:
        return False
    warn_once(
        name,
        f"ficache: {name}={raw!r} is neither on ({', '.join(SWITCH_ON)}) nor off "
        f"({', '.join(SWITCH_OFF)}); keeping the default, on",
    )
    return True


def registry_timeout(warn_once: Callable[[str, str], None] = _warn_once) -> float:
    """``FICACHE_REGISTRY_TIMEOUT``: seconds a start waits, per phase, on a registry server
    that stopped answering (``ficache.deadline``; default 60). A value that is not a
    positive number is one warning (``warn_once(key, message)``: the plugin's own
    logger), and the default."""
    from ficache.deadline import DEFAULT_REGISTRY_TIMEOUT_S

    raw = os.environ.get(ENV_REGISTRY_TIMEOUT, "").strip()
    if not raw:
        return DEFAULT_REGISTRY_TIMEOUT_S
    try:
        seconds = float(raw)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        warn_once(
            "timeout",
            f"ficache: {ENV_REGISTRY_TIMEOUT}={raw!r} is not a positive number of seconds; "
            f"using {DEFAULT_REGISTRY_TIMEOUT_S:g}",
        )
        return DEFAULT_REGISTRY_TIMEOUT_S
    return seconds


def adopt_at_start(
    sources: Callable[[], Any],
    *,
    what: str,
    known: Any,
    provenance: dict[str, Any],
    timeout: float,
    log: logging.Logger,
    with_stores: bool = False,
) -> None:
    """Rank 0, a plugin's first start: adopt the engine's own tuning files (``sources()``
    gives their ``ficache.adopt.Sources``; called here, so that a failure to import or
    find them is a warning too; ``what`` names them in the log, e.g. "vLLM's FlashInfer
    autotune caches") when the registry (``FICACHE_DB``) holds nothing for this
    environment (``ficache.adopt.adopt_into_empty_registry``), before rank 0 exports, so
    every rank loads what was adopted. One info line says what was adopted
    (``with_stores``: also how many v2 environments). Never raises: any failure is one
    warning on ``log``, and the start goes on without it."""
    try:
        from ficache.adopt import adopt_into_empty_registry
        from ficache.fingerprint import collect

        outcome = adopt_into_empty_registry(
            os.environ.get("FICACHE_DB"),
            collect(),
            sources(),
            known=known,
            provenance=provenance,
            registry_timeout=timeout,
        )
    except Exception as exc:  # noqa: BLE001 - adoption must never stop a start
        log.warning(
            "ficache: did not adopt %s (%s: %s); starting without them",
            what,
            type(exc).__name__,
            exc,
        )
        return
    if outcome is None:
        return  # the registry already holds entries for this environment
    adopted, result = outcome.plan, outcome.result
    if adopted.is_empty:
        log.debug("ficache: none of %s to adopt under %s", what, adopted.sources.display)
        return
    log.info(
        "ficache: adopted %s into the registry: %d entries (%d shared, %d scoped)%s from "
        "%d file(s) in %d layout(s)%s, %d added%s; skipped %d",
        what,
        len(adopted.entries),
        adopted.shared,
        adopted.scoped,
        f" and {len(adopted.records)} records" if adopted.records else "",
        adopted.files,
        len(adopted.layouts),
        f" and {len(adopted.stores)} v2 environment(s)" if with_stores else "",
        result.added,
        f" (commit {result.commit_id})" if result.commit_id is not None else "",
        adopted.skipped_count,
    )


def log_report(log: logging.Logger, report: Any, layout: str, *, unit: str) -> None:
    """A plugin's one info line for a warm start (``report``: its ``WarmStartReport``):
    ``ficache: <kind> <unit> on rank R/W (<layout>): loaded N, tuned N, committed N ...``.
    ``unit`` is what the engine calls it (vLLM: ``start``, SGLang: ``pass``). The kind is
    the start's status (``cold``, ``warm``, ...), or ``replay`` for a replay start that used
    the registry (an uncached one says ``uncached``, as in tune mode), which also says
    ``missed N``."""
    status = report.status
    replay = report.mode == "replay"
    log.info(
        "ficache: %s %s on rank %d/%d (%s): loaded %d, tuned %d, committed %d%s%s in %.2f s%s",
        "replay" if replay and status != "uncached" else status,
        unit,
        report.rank,
        report.world_size,
        layout,
        report.loaded,
        report.tuned,
        report.committed,
        f" (commit {report.commit_id})" if report.commit_id is not None else "",
        f", missed {report.missed}" if replay else "",
        report.total_seconds,
        f"; {report.reason}" if report.reason else "",
    )


__all__ = [
    "DEFAULT_MODE",
    "ENV_ADOPT",
    "ENV_MODE",
    "ENV_REGISTRY_TIMEOUT",
    "MODES",
    "adopt_at_start",
    "log_report",
    "registry_timeout",
    "start_mode",
    "switch",
]
