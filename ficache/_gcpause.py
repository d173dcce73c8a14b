"""Pause Python's cyclic garbage collector around bulk allocation.

Reading a cache file, planning a merge or building a commit allocates
hundreds of thousands of small objects that form no reference cycles. With
the collector on, every few hundred allocations trigger a collection that
rescans the young objects, and as the heap grows older generations are
rescanned again and again (in a process that imported torch, each full
collection walks millions of objects).

Re-enabling the collector after such a block would still scan everything
the block allocated, at the next allocation, and again when the survivors
age into the middle generation: at 1M entries those two scans took 3.4 s of
a 30 s merge. So a block that allocated many objects hands them to the
oldest generation unscanned (``gc.freeze()`` then ``gc.unfreeze()``, which
moves every tracked object there and resets the young count), where only a
full collection looks at them. The caller's own young objects go with them;
a cycle among those is freed by the next full collection instead of an
earlier young one.

Invariants:
- Reference counting still frees everything; only the cycle collector waits.
  Every object stays tracked: a full collection still finds any cycle.
- The collector's state is restored on exit, also on exceptions; a caller
  that had disabled it finds it still disabled. Nested pauses are fine.
- Objects the caller froze (``gc.freeze()``, e.g. before forking) stay
  frozen: when any are, the block's objects are left to the collector as is.
  (A thread that freezes objects while another leaves a block is not
  guarded against.)
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

#: Young objects a block must leave behind for them to be handed to the oldest
#: generation unscanned (a young collection of fewer costs under a millisecond).
PROMOTE_AFTER = 10_000


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """Disable the cyclic collector for the ``with`` block, then restore its state."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            if gc.get_count()[0] > PROMOTE_AFTER and not gc.get_freeze_count():
                gc.freeze()
                gc.unfreeze()
            gc.enable()
