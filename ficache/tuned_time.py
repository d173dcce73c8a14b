"""When an ingested result was tuned: the one rule every ingest path applies.

Owns ``tuned_at``, nothing else. Every path that brings tuned results into a
registry (``import`` of FlashInfer files, bundles and v2 stores, ``import
--from-vllm`` adoption, ``merge`` of files, bundles and registries) dates each
entry and record with it, so ``--on-conflict newest`` picks the same value
whichever way the same content came in.

Invariant: the time depends on the content and its file only, never on the
path it came through.
"""

from __future__ import annotations

import os
import time


def tuned_at(said: float | None, path: str | os.PathLike[str] | None = None) -> float:
    """When a result was tuned: what its source says, else its file's mtime, else now.

    - ``said``: the time the source itself records (a bundle's entry, a
      registry's row); it always wins.
    - else the modification time of the file that holds the result (a
      FlashInfer cache file, a v2 store's entry file, the bundle file for the
      records a bundle carries without a time): FlashInfer and vLLM write a
      file right after the tuning that produced it.
    - else (no file, or one that cannot be looked up) now.
    """
    if said is not None:
        return said
    if path is not None:
        try:
            return os.stat(path).st_mtime
        except (OSError, ValueError):  # gone, unreadable, or a name the OS refuses
            pass
    return time.time()


__all__ = ["tuned_at"]
