"""What the engine plugins (vLLM, SGLang) read from the environment, read in one place.

Every engine plugin calls these functions rather than reading the variables
itself, so one variable means one thing whichever engine runs the start.

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

logger = logging.getLogger("ficache.engine")

ENV_MODE = "FICACHE_MODE"
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


def start_kind(status: str, mode: str) -> str:
    """A plugin log line's first word: the start's status (``cold``, ``warm``, ...), or
    ``replay`` for a replay start that used the registry (an uncached one says
    ``uncached``, as in tune mode)."""
    kind = status.split(":")[0]
    return "replay" if mode == "replay" and kind != "uncached" else kind


def missed_clause(mode: str, missed: int) -> str:
    """What a plugin's log line adds for a replay start: ``, missed N`` (else nothing)."""
    return f", missed {missed}" if mode == "replay" else ""


__all__ = ["DEFAULT_MODE", "ENV_MODE", "MODES", "missed_clause", "start_kind", "start_mode"]
