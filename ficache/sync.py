"""The startup protocol: ``warm_start``, a distributed warm start of FlashInfer's autotuner.

::

    with ficache.warm_start(group) as ws:   # every rank of one gloo group
        run_warmup_forward_passes()         # FlashInfer tunes what is missing
    print(ws.report)                        # loaded, tuned, committed, commit id, seconds per phase

Protocol. Every rank of ``group`` runs every step below, in this order, on
every path. A failure is a value that travels to the next collective, never
a rank that leaves early. The steps are written once, in order, as
``WarmStart.ENTER_STEPS`` and ``WarmStart.EXIT_STEPS`` (one method per step,
whose docstring says which ranks do what and why every rank reaches the next
collective); a step that is taken only on some paths (the trouble all-gather
of step 5, the failure all-gather of step 8, the commit of step 9) decides
on data every rank holds identically, received in an earlier collective.
Everything that travels is a typed message of ``ficache.messages``
(``SliceOffer``, ``LoadConfirmation``, ``StatusReport``, ``CommitOutcome``,
...); a message that does not decode is one clear error, turned into the
start's reason like any other failure. The state of a start is grouped by
what it is about (``_EnterState``, ``_Loaded``, ``_TuningGroupState``,
``_Verdict``, ``_ExitState``).

On enter:

1. Each rank collects its fingerprint and clears its tuner: for the block,
   ``warm_start`` owns the AutoTuner's cache, and every rank starts from
   exactly its slice. A tuner that can keep a slice (``kept_slice``) is
   cleared at step 4 instead, right before its load.
2. Rank 0 opens the registry and exports one slice per rank for its own
   fingerprint (``ficache.slices``): the shared entries plus that rank's
   entries scoped to ``layout``. With ``reuse`` (a later pass of one
   process) it reads nothing when the earlier start served: every rank then
   loads what that start left it holding (``SliceOffer.reused``). After the exit steps it marks the
   fingerprints the slices came from as served (``ficache.usage.mark_served``:
   one statement, on a SQLite file written on a thread of its own after the
   start returns, a wait of at most 0.25 s, skipped silently when the
   registry is read-only or busy, or when the start's commit met the registry
   failing; never a reason for a start to fail).
3. One broadcast carries the slices (a base every rank loads, plus an
   overlay per rank where its scoped entries differ), or the reason there
   are none.
4. A rank whose fingerprint equals rank 0's loads its slice. A rank whose
   tuner provably holds exactly that slice already (an earlier start of this
   process loaded the same texts and protocol records, and nothing the tuner
   holds changed since: ``FlashInferTuner.kept_slice``) keeps it instead of
   clearing and loading, and counts what that load counted, so its
   confirmation is the one a load would send (``report.load_kept``). Every
   other rank that loads nothing still clears.
   4b. v2 mode (``ficache.v2_mode``): the slice is also served as a
   FlashInfer managed store of the rank's own, attached in place of any
   store attached before, and every ``autotune_v2`` of the block is sent to
   it (written at once with ``v2=True`` or a store already attached, else at
   the block's first ``autotune_v2`` call); a rank that cannot is a failed
   load (step 5). At exit (step 7) what the block tuned into the store is
   read back and joins the new entries.
5. One all-gather (a few integers) confirms fingerprints and loads.
   Fingerprints that differ, a load that failed anywhere, or ranks that
   loaded different numbers of entries: every rank clears and tunes from
   empty.
6. The tuning group is set (``set_autotune_process_group``).

On exit, also when the block raised:

7. The tuning group is cleared (in ``finally``).
8. One all-gather of every rank's status: did its block raise, how many new
   entries it holds (entries it tuned that differ from what it loaded).
9. Only when something was tuned: the new entries are gathered to rank 0,
   which commits them in one transaction, and one broadcast carries the
   outcome and the final slices (the registry's state after the commit) to
   every rank, which loads its own. When nothing was tuned every rank already
   knows the outcome from step 8 (the same data everywhere), so every rank
   logs the same thing either way.

Decisions:

- Replay mode (``mode="replay"``): the steps are the same, with the same
  collectives, and rank 0's mode travels in the ``SliceOffer`` (step 3), so
  every rank follows it: one rank never profiles where another only looks
  up. After enter, each rank opens its tuner's replay block
  (``FlashInferTuner.replay``): FlashInfer never profiles in it, even under an
  engine's own ``autotune(True)``, and a key the loaded slice lacks gets
  FlashInfer's fallback tactic. Every rank loaded the same broadcast slice
  and nobody times anything, so every rank of every server gets the same
  tactics on every boot of one registry state. Step 7 closes the block:
  ``report.missed`` is the distinct keys this rank looked up and missed. A
  replay start never commits (step 9 never runs: nothing counts as new), and
  rank 0 leaves its served mark after the block instead of at step 2, with
  the misses (``ficache.usage``): still one UPDATE per start.
- Heterogeneous ranks (fingerprints differ): nothing is loaded and nothing is
  committed, because no single fingerprint describes what they tune. The
  tuning group is still set: they start from the same (empty) cache, so they
  profile the same sequence and pick the same tactics, which keeps the
  kernels of later collectives consistent across ranks.
- Any failure on any rank (registry unusable on rank 0, a load, the block
  raising, a rank unable to read its tuner, a collective) means nothing is
  committed; the reason is in every rank's report and logged once per rank.
  An exception raised in the block propagates out of ``with`` on its rank,
  after the protocol completed on every rank.
- A registry that can be read but not written (read-only, or locked longer
  than ``busy_timeout``) still serves its entries; only the commit is
  skipped, or fails and leaves the registry as it was.
- A registry server that stops answering (PostgreSQL frozen mid-query) costs
  at most ``registry_timeout`` per phase: rank 0's export (step 2) and its
  commit (step 9) each run under ``ficache.deadline.registry_deadline``,
  which cuts the connection when the limit passes. A cut export means "tune
  uncached"; a cut commit means nothing was committed as far as this start
  knows, and every rank keeps what it tuned. Within that limit, a server
  that refuses for now (too many clients, starting up or shutting down, a
  connection refused or reset, a serialization failure) is asked again with
  jittered backoff (``ficache.retrying``). The commit carries a token
  (``Registry.write(once_token=...)``): a retried commit looks it up under the
  registry's write lock, behind an earlier attempt still landing, and reports
  that attempt's commit instead of writing again, so it never lands twice.
- Concurrent servers: when two servers of one fingerprint commit the same
  key (and scope) with different values, the value committed first wins;
  the later one is not written and is counted in ``report.kept`` (see
  ``WarmStart._commit``).
- Shared or scoped (rank 0 applies these rules with ``ficache.startup_commit``,
  which also builds the commit and counts what it wrote): a new entry equal
  (runner, tactic, policy) on every rank of a synchronized start is stored
  shared; every other new entry (tactics that differ, or a key only some
  ranks produced) is stored once per rank
  that produced it, scoped to that rank of ``layout``. Entries of a start
  that was not synchronized (``synchronize=False``) are never stored shared.
  A selection (how FlashInfer chose the tactic, from each rank's own
  timings) is never compared: a shared entry stores rank 0's, a scoped one
  its rank's.
- Namespaced records (FlashInfer's ``_records``, ``ficache.records``) travel
  like entries: the slices carry them (``ficache.slices``), so every rank's
  ``get_namespaced_records`` returns them after the load, and the records a
  rank holds at exit that differ from those it held right after the load
  (published during the block; kept as data at the load, never read back
  from the slice texts, whose layout is ``render_cache``'s business) are
  gathered with its new entries and committed by rank 0 in the same
  startup commit. A record (namespace, key) with the same value on
  every rank of a synchronized start is stored shared; every other one
  (values that differ, or a key only some ranks published) is stored once
  per rank that published it, scoped to that rank of ``layout``, and that
  rank gets it back in its overlay. A start only adds records: as for
  entries, the value already stored wins (``keep_existing``), so a record
  republished with another value is not stored and is counted in
  ``report.kept`` (replace stored records with ``ficache import`` or
  ``merge``). A record JSON cannot carry exactly is skipped, with a warning.
- Protocol records (FlashInfer 0.7.4's ``publish_protocol_record``,
  ``ficache.protocol_records``) are stored shared, so the ``SliceOffer``
  carries one map every rank publishes after its load (``Tuner.publish_protocol``:
  in memory, ``persist=False``, under the identity a v1 block reads; in v2
  mode also as protocol entry files of the store it serves). At exit a rank
  holds as new the ones that differ from what it held after the load
  (``Tuner.protocol_records``; in v2 mode the store's files too); they travel
  in ``TunedResults`` and rank 0 stores them shared in the startup commit
  (``startup_commit.classify_protocol``: rank 0's value; one only other ranks
  published when they agree), keeping a stored value as for entries. The
  final ``CommitOutcome`` carries the registry's map after the commit, which
  every rank publishes again. A FlashInfer without them publishes none (a
  warning); the counts are ``report.protocol_loaded``, ``protocol_tuned`` and
  ``protocol_committed``, and a start whose ranks only published protocol
  records is "partial" on every rank, as for entries.
- The tuning group. FlashInfer's all-reduces run on a dedicated gloo group
  (one per process and caller group, created collectively with
  ``torch.distributed.new_group`` the first time and reused), not on
  ``group``, so tuning all-reduces can never interleave with the protocol's
  own collectives, and the tuning group can be released. A rank whose block
  raised releases it at once; a rank that finished its block waits
  ``release_grace`` seconds for the others at step 8, then releases it. A peer
  still blocked in a tuning all-reduce (it missed where this rank hit, or
  this rank failed) then fails at once ("Connection closed by peer") instead
  of waiting out the group's timeout (30 minutes by default). Releasing is
  safe at that point: a rank that has left its block never all-reduces
  again, so a peer's pending or later all-reduce could never complete.
  ``new_group`` must be called by every rank of the default group, so when
  ``group`` is smaller than the world, tuning all-reduces run on ``group``
  itself and cannot be released early.
- Bounded waits: ``timeout`` bounds every wait for a stalled peer (see
  ``WarmStart``), whatever ``group``'s own timeout, because a server's group
  (vLLM's) is made by the server, with its own timeout. A wait that ran out
  leaves its collective pending on that rank and breaks the channel: the rank
  issues no further protocol collective and commits nothing (the late peer's
  matching collective may still complete against the pending one; its next
  wait then fails or runs out, so it commits nothing either). A tuning
  collective that timed out has waited for the peers once already, so the
  exchange after it waits only ``release_grace`` more: a stalled peer costs
  the timeout once, not twice (``tests/test_killed_ranks.py``, slow cases).

Cost: a warm start with nothing to tune is four collectives on ``group`` plus
one ``load_configs`` per rank, or none on a rank that keeps its slice (a
comparison of the tuner's containers with a snapshot instead). Rank 0 reads
rendered slices from the slice cache (``ficache.slices``) after checking the
registry's state over one read-only SQLite connection, and the tuner adapter
pauses the garbage collector during ``load_configs``; see
``benchmarks/warm_start.py``.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeVar, cast

import torch
import torch.distributed as dist

from ficache import startup_commit
from ficache.deadline import DEFAULT_REGISTRY_TIMEOUT_S, registry_deadline
from ficache.engine_env import MODES
from ficache.errors import (
    FicacheError,
    RegistryBusyError,
    RegistryReadOnlyError,
    RegistryTimeoutError,
    TunerError,
)
from ficache.fingerprint import ALL_FIELDS, Fingerprint, collect
from ficache.flashinfer_format import (
    canonical_json,
    check_namespace,
    check_protocol_identity,
    record_value_json,
)
from ficache.messages import (
    CommitOutcome,
    FailureNote,
    LoadConfirmation,
    LoadTrouble,
    MalformedMessageError,
    SliceOffer,
    StatusReport,
    TunedResults,
    TuningGroupCreated,
)
from ficache.retrying import retry_transient
from ficache.scopes import rank_scope
from ficache.tuner import FlashInferTuner, Row, Tuner, row_value
from ficache.values import NewProtocolRecord, NewRecord, WriteResult

if TYPE_CHECKING:
    # Only rank 0 reads or writes the registry: it imports these (SQLAlchemy,
    # Alembic) where it opens one, so the other ranks never load them.
    from ficache.registry import Registry
    from ficache.v2_mode import V2Mode

logger = logging.getLogger(__name__)

T = TypeVar("T")
MsgT = TypeVar("MsgT")

#: gloo's default timeout, used when ``timeout`` is None.
DEFAULT_TIMEOUT_S = 1800.0

#: The shortest wait on a collective: ``Work.wait`` reads a zero timeout (under 1 ms)
#: as "no timeout" and would wait forever.
_MIN_WAIT_S = 0.001

# caller group id -> (caller group, its dedicated tuning group)
_TUNING_GROUPS: dict[int, tuple[Any, Any]] = {}


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {text}" if text else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


#: What ended a failed collective, in gloo's words: a peer gone or a wait run out.
_COLLECTIVE_CAUSE = re.compile(
    r"Connection (?:closed|reset) by peer|Broken pipe|Connection refused|[Tt]imed out[^.;,\[\]]*"
)


def _collective_error(exc: BaseException) -> str:
    """A failed collective in a few words: gloo's cause without its file, line and banner."""
    if isinstance(exc, TimeoutError):  # ``_Channel._wait``'s own one line
        return _one_line(exc)
    cause = _COLLECTIVE_CAUSE.search(str(exc))
    return f"{type(exc).__name__}: {cause.group(0).strip()}" if cause else _one_line(exc)


#: ``WarmStartReport.status``, a fixed set: "starting" (the start has not ended), "warm"
#: (every rank loaded its slice and tuned nothing), "partial" (loaded, and some rank tuned
#: more), "cold" (nothing to load; tuned), "uncached" (the registry was not used; the
#: start tuned from an empty cache and ``reason`` says why).
STATUSES = ("starting", "warm", "partial", "cold", "uncached")


@dataclass
class WarmStartReport:
    """What one warm start did, as seen by one rank (``as_json`` for machines)."""

    rank: int = 0
    world_size: int = 1
    layout: str = "world1"
    fingerprint: str | None = None  # digest of this rank's fingerprint
    registry: str | None = None  # where rank 0 read (and wrote) entries
    status: str = "starting"  # one of STATUSES; why, when anything went wrong: ``reason``
    reason: str | None = None  # why nothing was loaded, or nothing committed
    loaded: int = 0  # entries this rank loaded
    tuned: int = 0  # new entries this rank produced
    committed: int = 0  # registry rows this start added or replaced (all ranks)
    commit_id: int | None = None
    shared: int = 0  # new keys this start stored shared
    scoped: int = 0  # new rows this start stored scoped to one rank of the layout
    disagreements: int = 0  # new keys whose value differed between ranks
    kept: int = 0  # new values not committed: another server had committed another value first
    records_loaded: int = 0  # namespaced records this rank loaded
    records_tuned: int = 0  # namespaced records this rank published that differ from the loaded
    records_committed: int = 0  # record rows this start added or replaced (all ranks)
    protocol_loaded: int = 0  # FlashInfer 0.7.4 protocol records this rank published from the slice
    protocol_tuned: int = 0  # protocol records this rank held at exit that differ from the loaded
    protocol_committed: int = 0  # protocol record rows this start added or replaced
    synchronized: bool = False  # tuning all-reduced over every rank, from matching caches
    slice_cache: str = "off"  # rank 0's slice cache: "hit", "miss" or "off"
    mode: str = "tune"  # "tune", or "replay": served the registry, never profiled
    missed: int = 0  # replay: distinct keys this rank looked up and the registry lacked
    load_kept: bool = False  # step 4: this rank's tuner already held exactly its slice, kept
    loaded_by_rank: list[int] = field(default_factory=list)
    tuned_by_rank: list[int] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    #: v2 mode (``ficache.v2_mode``): the store this rank served and read back, else None.
    v2: dict[str, Any] | None = None

    @property
    def total_seconds(self) -> float:
        return self.seconds.get("total", 0.0)

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# --------------------------------------------------------------------------
# Collectives on the caller's group. Any failure breaks the channel on this
# rank: later steps skip their collectives and the start ends uncommitted.


class _Channel:
    """The protocol's collectives on ``group``; ``timeout`` bounds the waits that wait
    for another rank's work (the broadcasts and the confirm): each call's waits share
    one deadline, so a stalled peer costs a rank the timeout once per call."""

    def __init__(self, group: Any, rank: int, world: int, timeout: float) -> None:
        self.group = group
        self.rank = rank
        self.world = world
        self.timeout = timeout
        self.error: str | None = None

    def _wait(self, work: Any, deadline: float) -> None:
        """Wait for ``work`` until ``deadline`` (``time.monotonic``); raise once it passed."""
        left = max(deadline - time.monotonic(), _MIN_WAIT_S)
        try:
            work.wait(timeout=datetime.timedelta(seconds=left))
        except Exception:
            if work.is_completed():
                # It completed between the timeout and this check, or it failed (a peer
                # gone): waiting again returns at once, or raises the collective's own error.
                work.wait()
                return
            raise TimeoutError(
                f"timed out: no answer within the warm start's timeout ({self.timeout:g} s)"
            ) from None

    def _call(self, what: str, fn: Callable[[], T]) -> T | None:
        if self.error is not None:
            return None
        try:
            return fn()
        except Exception as exc:  # noqa: BLE001 - a failed collective is a value
            self.error = f"{what} failed on rank {self.rank}: {_collective_error(exc)}"
            logger.error("ficache warm start: %s", self.error)
            return None

    def broadcast(self, data: bytes | None) -> bytes | None:
        """Rank 0's ``data`` (an encoded message; the others pass None) on every rank, as two
        tensor broadcasts (its size, its bytes) whose waits ``timeout`` bounds."""
        if self.world == 1:
            return data

        def run() -> bytes:
            deadline = time.monotonic() + self.timeout
            if self.rank == 0:
                assert data is not None, "rank 0 broadcasts a message"
                size = torch.tensor([len(data)], dtype=torch.int64)
            else:
                size = torch.zeros(1, dtype=torch.int64)
            self._wait(dist.broadcast(size, group=self.group, group_src=0, async_op=True), deadline)
            if int(size.item()) == 0:  # every rank knows: no second broadcast
                return b""
            if self.rank == 0 and data is not None:
                sent = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            else:
                sent = torch.empty(int(size.item()), dtype=torch.uint8)
            self._wait(dist.broadcast(sent, group=self.group, group_src=0, async_op=True), deadline)
            return data if self.rank == 0 and data is not None else sent.numpy().tobytes()

        return self._call("broadcast", run)

    def all_gather(self, obj: Any) -> list[Any] | None:
        if self.world == 1:
            return [obj]

        def run() -> list[Any]:
            out: list[Any] = [None] * self.world
            dist.all_gather_object(out, obj, group=self.group)
            return out

        return self._call("all-gather", run)

    def all_gather_ints(self, values: list[int]) -> list[list[int]] | None:
        """All-gather a few integers (one collective, no pickling)."""
        if self.world == 1:
            return [values]

        def run() -> list[list[int]]:
            deadline = time.monotonic() + self.timeout
            mine = torch.tensor(values, dtype=torch.int64)
            out = [torch.zeros_like(mine) for _ in range(self.world)]
            self._wait(dist.all_gather(out, mine, group=self.group, async_op=True), deadline)
            return [[int(v) for v in t.tolist()] for t in out]

        return self._call("all-gather", run)

    def gather(self, obj: Any) -> list[Any] | None:
        """Everyone's ``obj`` on rank 0 (others get ``[]``)."""
        if self.world == 1:
            return [obj]

        def run() -> list[Any]:
            out: list[Any] | None = [None] * self.world if self.rank == 0 else None
            dist.gather_object(obj, out, group=self.group, group_dst=0)
            return out if out is not None else []

        return self._call("gather", run)

    def exchange(
        self, values: list[int], grace: float, timeout: float, on_stall: Callable[[], None]
    ) -> list[list[int]] | None:
        """All-gather a few integers; call ``on_stall`` if peers are not there within ``grace``."""
        if self.world == 1:
            return [values]

        def run() -> list[list[int]]:
            mine = torch.tensor(values, dtype=torch.int64)
            out = [torch.zeros_like(mine) for _ in range(self.world)]
            work = dist.all_gather(out, mine, group=self.group, async_op=True)
            assert work is not None
            try:
                work.wait(timeout=datetime.timedelta(seconds=max(grace, _MIN_WAIT_S)))
            except Exception:
                if work.is_completed():
                    raise
                on_stall()
                work.wait(timeout=datetime.timedelta(seconds=max(timeout, _MIN_WAIT_S)))
            return [[int(v) for v in t.tolist()] for t in out]

        return self._call("status exchange", run)


def _encoded(message: Any, what: str) -> bytes:
    """``message.encode()``, or, when it cannot be encoded, bytes that decode to no message
    (empty: "truncated"), so the receivers take the failure as a value; logged here."""
    try:
        return bytes(message.encode())
    except Exception as exc:  # noqa: BLE001 - a rank never leaves the protocol early
        logger.error("ficache warm start: could not encode %s: %s", what, _one_line(exc))
        return b""


class _NoTuner:
    """Stands in for a tuner that could not be created: holds nothing, loads nothing."""

    def clear(self) -> None:
        pass

    def load(self, text: str) -> int:
        raise TunerError("no tuner")

    def entries(self) -> dict[str, Row]:
        return {}

    def tuned(self) -> dict[str, Row]:
        return {}

    def set_process_group(self, group: Any | None) -> None:
        pass


# --------------------------------------------------------------------------
# The dedicated tuning group.


def _cached_tuning_group(group: Any) -> Any | None:
    entry = _TUNING_GROUPS.get(id(group))
    return entry[1] if entry is not None and entry[0] is group else None


def _drop_tuning_group(group: Any) -> None:
    entry = _TUNING_GROUPS.pop(id(group), None)
    if entry is not None and entry[0] is group:
        with suppress(Exception):
            dist.destroy_process_group(entry[1])


def _holds(frame: Any, target: Any) -> bool:
    for value in frame.f_locals.values():
        if value is target:
            return True
        if isinstance(value, dict):
            if any(v is target for v in value.values()):
                return True
        elif isinstance(value, (tuple, list)) and any(v is target for v in value):
            return True
    return False


def _drop_frame_references(exc: BaseException | None, target: Any) -> None:
    """Clear the locals of finished frames in ``exc``'s traceback that hold ``target``.

    A rank whose tuning all-reduce failed holds the tuning group in the
    locals of the frames it failed in (torch.distributed's, and any caller
    that kept the group in a variable). gloo closes a group's connections
    only when its last reference goes, so without this a failed rank would
    keep its sockets open and stall the peers still waiting on it.
    """
    seen: set[int] = set()
    while target is not None and exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        tb = exc.__traceback__
        while tb is not None:
            with suppress(Exception):
                if _holds(tb.tb_frame, target):
                    tb.tb_frame.clear()  # RuntimeError for a frame still running: skipped
                    # Reading f_locals cached a snapshot of them on the frame;
                    # reading it again after clear() empties that snapshot.
                    _ = tb.tb_frame.f_locals
            tb = tb.tb_next
        exc = exc.__cause__ or exc.__context__


def _describe_difference(fields: list[dict[str, str] | None]) -> str:
    """Which fingerprint fields differ between ranks, for a one-line reason."""
    diffs = []
    for name in ALL_FIELDS:
        values = [f.get(name) if f else None for f in fields]
        if len(set(values)) > 1:
            diffs.append(f"{name} ({', '.join(f'rank{r}={v}' for r, v in enumerate(values))})")
    return "; ".join(diffs[:3]) or "fingerprint"


# --------------------------------------------------------------------------


# The state of one start, grouped by what it is about. Each is written by the
# steps named in its docstring and read by the later ones.


@dataclass
class _Clock:
    """When the start began and when its block began (``time.perf_counter``)."""

    started: float = 0.0
    block_started: float = 0.0


@dataclass
class _EnterState:
    """What enter's steps learn, in step order (written by steps 1-5, read after them)."""

    rank: int = 0
    world: int = 1
    layout: str = "world1"
    fp: Fingerprint | None = None  # step 1
    local_error: str | None = None  # step 1: why this rank cannot take part
    offer: SliceOffer | None = None  # step 2 (rank 0's own), then step 3 (everyone's)
    load_ok: bool = True  # step 4
    loaded: int = 0  # step 4: entries this rank loaded
    load_error: str | None = None  # step 4
    tuning_group_cached: bool = False  # step 5: every rank still holds the tuning group
    clear_pending: bool = False  # step 1 left the clear to step 4 (``_load_texts``)


@dataclass
class _Loaded:
    """What the tuner held right after its last load: the slice texts, and its records as
    canonical JSON (kept as data at the load; ``_new_entries`` and ``_new_records`` compare
    against them)."""

    texts: list[str] = field(default_factory=list)
    records: dict[str, dict[str, str]] = field(default_factory=dict)
    #: The protocol records published with the texts (the slice's), and those held after.
    protocol_served: dict[str, dict[str, str]] = field(default_factory=dict)
    protocol: dict[str, dict[str, str]] = field(default_factory=dict)
    published: int = 0  # of ``protocol_served``, how many the tuner published
    kept: bool = False  # the tuner already held exactly these: not cleared, not loaded


@dataclass
class _TuningGroupState:
    """The tuning group this rank set (step 6), and whether it was released (steps 7-8)."""

    group: Any = None
    dedicated: bool = False
    released: bool = False


@dataclass
class _Verdict:
    """Why the start is not whole, shared by every phase (read by ``_finish``)."""

    uncached: str | None = None  # why the registry is not used at all (step 5)
    no_commit: str | None = None  # why nothing may be committed (any step)
    outcome_unknown: str | None = None  # why rank 0's commit outcome never arrived (step 9)
    readonly: bool = False  # the registry can be read, not written (step 3)
    rank_failed: bool = False  # a rank raised, or could not take part (step 8)
    commit_failed: bool = False  # rank 0's commit met the registry failing (step 9)
    anyone_tuned: bool = False  # a status said a rank holds something new (step 8)


@dataclass
class _Replay:
    """Replay mode (rank 0's mode, which every rank takes at step 3): the tuner's replay
    block, open from the end of enter to step 7, and what it looked up."""

    guard: Any = None  # the tuner's ``replay()`` context manager; None: it has none
    lookups: Any = None  # ``ficache.tuner.ReplayLookups``


@dataclass
class _ExitState:
    """What exit's steps learn (steps 7-9)."""

    exc: BaseException | None = None  # what the block raised on this rank
    failed_at: float = 0.0  # wall clock: the earliest failure is the root cause
    new: dict[str, Row] = field(default_factory=dict)  # step 7: entries new on this rank
    new_records: dict[str, dict[str, str]] = field(default_factory=dict)
    new_protocol: dict[str, dict[str, str]] = field(default_factory=dict)
    tuner_error: str | None = None  # step 7: this rank could not read its tuner
    statuses: list[StatusReport] | None = None  # step 8: everyone's, or None on a failure
    outcome: CommitOutcome | None = None  # step 9

    @property
    def raised(self) -> bool:
        return self.exc is not None


def _check_record_identity(namespace: Any, key: Any) -> None:
    """``ValueError`` unless ``(namespace, key)`` names a namespaced record FlashInfer keeps."""
    check_namespace(namespace)
    if not isinstance(key, str) or not key:
        raise ValueError("a record key is not a non-empty string")


def _canonical_held(
    held: Any, check_identity: Callable[[Any, Any], None]
) -> tuple[dict[str, dict[str, str]], int]:
    """``{namespace: {key: value}}`` a tuner holds (records or protocol records) as canonical
    JSON, and how many items were skipped: a bad identity, or a value JSON cannot carry."""
    out: dict[str, dict[str, str]] = {}
    skipped = 0
    for ns, by_key in (held or {}).items():
        if not isinstance(by_key, dict):
            skipped += 1
            continue
        for key, value in by_key.items():
            try:
                check_identity(ns, key)
                text = record_value_json(value)
            except (ValueError, RecursionError):
                skipped += 1
                continue
            out.setdefault(ns, {})[key] = text
    return out, skipped


def _changed(
    held: dict[str, dict[str, str]], loaded: dict[str, dict[str, str]]
) -> dict[str, dict[str, str]]:
    """The items of ``held`` absent from ``loaded`` or holding another value there."""
    new: dict[str, dict[str, str]] = {}
    for ns, by_key in held.items():
        for key, text in by_key.items():
            if loaded.get(ns, {}).get(key) != text:
                new.setdefault(ns, {})[key] = text
    return new


# --------------------------------------------------------------------------


class WarmStart:
    """A warm start of FlashInfer's autotuner, entered by every rank of ``group``.

    ``group`` is a gloo process group (None: the default group, or a single
    process when torch.distributed is not initialized). Ranks are ranks
    within ``group`` (``dist.get_rank(group)``), never global ranks: with
    groups smaller than the world (vLLM's TP groups under pipeline
    parallelism), each group's rank 0 reads and commits, rank scopes name
    the rank within the group, and no collective leaves the group. Only rank 0 reads
    ``db`` (a path or SQLAlchemy URL; None: ``FICACHE_DB``, then the default
    registry). ``layout`` names the rank layout for rank-scoped entries
    (default ``f"world{N}"``). ``tuner=None`` is FlashInfer's ``AutoTuner``.
    ``fingerprint`` overrides the collected one. ``synchronize=False`` tunes
    without a process group (entries are then stored per rank only).
    ``timeout`` (default 1800 s) bounds every wait for a stalled peer,
    whatever ``group``'s own timeout (the one it was created with, 30 minutes
    by default): the slice broadcast and the confirm (steps 3 and 5), the
    status exchange (step 8), the outcome broadcast (step 9) and the tuning
    group's collectives. A peer that stalls costs the others the timeout once
    (plus ``release_grace`` twice at most, in the exchange), never twice.
    Only the all-gather of failure details and the gather of tuned entries,
    which run right after a collective every rank completed, wait as long as
    ``group``'s timeout allows. Give ``timeout`` room for rank 0's commit
    (``registry_timeout``): a peer that stops waiting for the outcome reports
    "commit outcome unknown". ``release_grace`` is how long a rank that
    left its block waits before releasing the tuning group;
    ``busy_timeout`` bounds each wait for the registry's write lock (the
    registry retries a busy write a few times). ``registry_timeout`` bounds
    rank 0's export and its commit, each, on a registry server that stops
    answering (PostgreSQL; None: no bound). ``slice_cache=False``
    bypasses the on-disk cache of rendered slices. ``provenance`` (rank 0's)
    is added to the commit's provenance (framework, model, ...). ``mode`` is
    ``"tune"`` (the default: FlashInfer profiles what the registry lacks, and
    rank 0 commits it) or ``"replay"`` (serve the registry, never profile,
    count the misses in ``report.missed``, commit nothing; rank 0's mode is
    every rank's); any other value raises ``ValueError`` before any collective.
    ``reuse`` is an earlier start of this process on the same group, already
    exited (an engine that tunes in several passes, ``ficache.sglang_plugin``):
    when it served its slices and the fingerprint is the same, rank 0 reads
    nothing from the registry and every rank loads what that start left it
    holding (its final slice, the same keys on every rank), so a process reads
    the registry once however many passes it tunes in; this start commits to
    the registry that one read (``report.slice_cache`` is ``"reused"``) and
    leaves its own served mark. Otherwise it reads as any start does.

    After the ``with`` block, ``.report`` is this rank's ``WarmStartReport``.

    The steps of a start are the methods named in ``ENTER_STEPS`` and
    ``EXIT_STEPS``, run in that order by every rank (see the module docstring).
    """

    #: Enter: (phase timed in ``report.seconds``, step), in the order every rank runs them.
    #: Collectives: distribute = one broadcast; confirm = one all-gather (+ one when a load
    #: failed or fingerprints differ); group = ``new_group`` and one all-gather when a
    #: dedicated tuning group is created (the first start, or after a release).
    ENTER_STEPS: tuple[tuple[str, str], ...] = (
        ("prepare", "_step_prepare"),  # 1. local: fingerprint, a clean tuner
        ("export", "_step_export"),  # 2. local, rank 0 only: the slices
        ("distribute", "_step_distribute"),  # 3. broadcast SliceOffer
        ("load", "_step_load"),  # 4. local: load this rank's slice
        ("v2", "_step_v2_serve"),  # 4b. local, v2 mode only: serve the slice as a store
        ("confirm", "_step_confirm"),  # 5. all-gather LoadConfirmation [+ LoadTrouble]
        ("group", "_step_tuning_group"),  # 6. [new_group, all-gather TuningGroupCreated]
    )
    #: Exit, also when the block raised. Collectives: exchange = one all-gather; failures =
    #: one all-gather when a rank failed; commit = one gather and one broadcast when
    #: something was tuned (phases "gather", "commit" and "final" inside it).
    EXIT_STEPS: tuple[tuple[str | None, str], ...] = (
        ("exchange", "_step_read_tuner"),  # 7. local: clear the group, read what is new
        ("exchange", "_step_exchange"),  # 8. all-gather StatusReport
        (None, "_step_share_failures"),  # 8b. [all-gather FailureNote]
        (None, "_step_commit"),  # 9. [gather TunedResults, broadcast CommitOutcome]
    )

    def __init__(
        self,
        group: Any = None,
        *,
        db: str | os.PathLike[str] | None = None,
        layout: str | None = None,
        tuner: Tuner | None = None,
        fingerprint: Fingerprint | None = None,
        synchronize: bool = True,
        timeout: float | None = None,
        release_grace: float = 5.0,
        busy_timeout: float | None = 5.0,
        registry_timeout: float | None = DEFAULT_REGISTRY_TIMEOUT_S,
        slice_cache: bool = True,
        provenance: dict[str, Any] | None = None,
        mode: str = "tune",
        v2: bool | None = None,
        measurement_policy: Any = None,
        v2_root: str | os.PathLike[str] | None = None,
        reuse: WarmStart | None = None,
    ) -> None:
        if mode not in MODES:
            raise ValueError(f"warm_start mode must be one of {', '.join(MODES)}, not {mode!r}")
        self.mode = mode
        self.group = group
        self.db = os.fspath(db) if db is not None else None
        self._layout = layout
        self._tuner = tuner
        self._fingerprint = fingerprint
        self.synchronize = synchronize
        self.timeout = float(timeout) if timeout is not None else DEFAULT_TIMEOUT_S
        self.release_grace = release_grace
        self.busy_timeout = busy_timeout
        self.registry_timeout = registry_timeout
        self.slice_cache = slice_cache
        self.provenance = dict(provenance or {})
        self.v2 = v2
        self.measurement_policy = measurement_policy
        self.v2_root = Path(v2_root) if v2_root is not None else None
        self._v2: V2Mode | None = None
        self._v2_eager = False
        self.report = WarmStartReport()
        self.tuner: Tuner
        self._channel: _Channel
        self._clock = _Clock()
        self._enter = _EnterState()
        self._loaded = _Loaded()
        self._tuning = _TuningGroupState()
        self._verdict = _Verdict()
        self._replay: _Replay | None = None
        self._served_ids: tuple[int, ...] = ()  # rank 0: the fingerprints its slices came from
        self._reuse = reuse
        self._exited = False  # set when the exit steps ran: a later start may reuse this one

    # -- helpers ----------------------------------------------------------

    def _phase(self, name: str, since: float) -> float:
        now = time.perf_counter()
        self.report.seconds[name] = round(self.report.seconds.get(name, 0.0) + now - since, 6)
        return now

    def _warn(self, message: str) -> None:
        if message not in self.report.warnings:
            self.report.warnings.append(message)

    def _deadline(self) -> Any:
        """The bound on one phase of rank 0's work on the registry (``registry_timeout``)."""
        from ficache.location import resolve

        return registry_deadline(self.registry_timeout, f"registry {resolve(self.db).display}")

    def _registry(self) -> Registry:
        from ficache import schema
        from ficache.registry import Registry

        reg = Registry.open(self.db)
        try:
            schema.bound_busy_timeout(reg.engine, self.busy_timeout)
        except Exception:
            reg.close()
            raise
        if reg.upgraded_from is not None:  # a local file older than this code reads: said once
            self._warn(
                f"upgraded registry {reg.location.display} from schema {reg.upgraded_from!r} "
                f"to {schema.head_revision()!r} (a local file older than this ficache reads)"
            )
        return reg

    # -- enter ------------------------------------------------------------

    def __enter__(self) -> WarmStart:
        self._clock.started = t = time.perf_counter()
        if dist.is_available() and dist.is_initialized():
            rank, world = dist.get_rank(self.group), dist.get_world_size(self.group)
            if rank < 0:  # torch's answer for a process outside ``group``
                raise ValueError(
                    "this process is not a member of the warm start's group: only the ranks "
                    "of that group call warm_start on it"
                )
        else:
            rank, world = 0, 1
        layout = self._layout or f"world{world}"
        rank_scope(layout, rank)  # validates the layout name (ValueError before any collective)
        report = self.report
        report.rank, report.world_size, report.layout = rank, world, layout
        report.synchronized = world == 1 and self.synchronize
        self._enter = _EnterState(rank=rank, world=world, layout=layout)
        self._channel = _Channel(self.group, rank, world, self.timeout)
        for phase, step in self.ENTER_STEPS:
            getattr(self, step)()
            t = self._phase(phase, t)
        if report.mode == "replay":
            self._open_replay()
        if self._verdict.uncached is not None:
            logger.warning(
                "ficache warm start rank %d/%d: tuning uncached: %s",
                rank,
                world,
                self._verdict.uncached,
            )
        self._clock.block_started = time.perf_counter()
        return self

    def _step_prepare(self) -> None:
        """1. Every rank, alone: collect the fingerprint, clear the tuner (a tuner that can
        keep a slice, ``Tuner.kept_slice``: at step 4, which knows the slice). No
        collective; a failure is kept as ``local_error`` (the load step turns it into a
        failed load)."""
        state = self._enter
        try:
            state.fp = self._fingerprint or collect()
            self.report.fingerprint = state.fp.digest
        except Exception as exc:  # noqa: BLE001 - becomes "tune uncached"
            state.local_error = (
                f"rank {state.rank} could not collect its fingerprint: {_one_line(exc)}"
            )
        try:
            self.tuner = self._tuner if self._tuner is not None else FlashInferTuner()
            if state.local_error is None and hasattr(self.tuner, "kept_slice"):
                state.clear_pending = True  # step 4 clears, or keeps an identical slice
            else:
                self.tuner.clear()
        except Exception as exc:  # noqa: BLE001
            state.local_error = (
                state.local_error
                or f"rank {state.rank} could not set up its tuner: {_one_line(exc)}"
            )
            if not hasattr(self, "tuner"):
                self.tuner = _NoTuner()
        if state.local_error is None:
            self._setup_v2()

    def _setup_v2(self) -> None:
        """Step 1, v2 mode (``ficache.v2_mode``): wrap the tuner so its loads can be served as
        a managed store. ``v2=True``: the store is written and attached at step 4b. Default
        (``v2=None``, where FlashInfer has ``autotune_v2``): at step 4b when FlashInfer already
        has a managed store attached (it would be consulted, and receive what is tuned,
        behind the start's back), else at the block's first ``autotune_v2`` call; a block
        that never calls it pays nothing. ``v2=False``: off. Never raises: a failure is
        one warning."""
        from ficache import v2_mode

        rank = self._enter.rank
        ambient = v2_mode.attached_store()
        if self.v2 is None and not isinstance(self.tuner, FlashInferTuner):
            return  # another tuner: v2 mode only when asked for
        if self.v2 is False:
            if ambient is not None:
                self._warn(
                    f"a FlashInfer managed store is attached ({getattr(ambient, 'root', ambient)}) "
                    "and v2=False: it is consulted, and receives what is tuned, so this start "
                    "may commit nothing of it; start with v2=None or True"
                )
            return
        why: str | None = None
        if not v2_mode.available():
            if self.v2 is None:
                return  # no managed store in this FlashInfer: nothing can bypass the start
            why = "this FlashInfer has no managed store (autotune_v2)"
        elif v2_mode.open_context_store() is not None:
            why = (
                "the start was entered inside an open autotune_v2 context, whose store is "
                "consulted and receives what is tuned; enter warm_start outside it"
            )
        if why is None:
            try:
                policy = self.measurement_policy
                fields = (
                    v2_mode.measurement_fields(policy)
                    if policy is not None or ambient is None
                    else v2_mode.store_measurement(ambient)
                )
                root = self.v2_root or v2_mode.process_root(rank)
                mode = v2_mode.V2Mode(root, fields, adopt_policy=policy is None)
                tuner = v2_mode.V2ModeTuner(self.tuner, mode)
                eager = self.v2 is True or ambient is not None
                if self._enter.clear_pending and not eager:
                    mode.wipe()  # the tuner's own clear is step 4's (``_load_texts``)
                else:
                    tuner.clear()
                    self._enter.clear_pending = False
            except Exception as exc:  # noqa: BLE001 - the start goes on in v1 mode
                why = f"could not set up its v2 store: {_one_line(exc)}"
            else:
                self.tuner, self._v2 = tuner, mode
                self._v2_eager = eager
                self._serve_measurement(mode.measurement)
                return
        self._warn(
            f"rank {rank}: v2 mode off: {why}; what the block tunes into a store is not committed"
        )

    def _serve_measurement(self, measurement: dict[str, str]) -> None:
        """Step 1, v2 mode: the start's fingerprint names the measurement policy its store is
        served under (given, or the attached store's), so it is served, and commits, that
        policy's entries alone (``Fingerprint.measurement``: another policy is another
        environment, as in FlashInfer's ``env_hash``). A policy adopted later, at the block's
        first ``autotune_v2`` call (``V2Mode.adopt``), leaves the fingerprint as it was:
        the slice was chosen before it was known."""
        fp = self._enter.fp
        if fp is not None and measurement and not fp.measurement:
            self._enter.fp = fp.with_measurement(measurement)
            self.report.fingerprint = self._enter.fp.digest

    def _step_export(self) -> None:
        """2. Rank 0 alone exports every rank's slice (``_export_payload`` never raises, and
        bounds its registry work by ``registry_timeout``); the other ranks go straight to
        the broadcast, where they wait for rank 0."""
        state = self._enter
        if state.rank == 0:
            offer = self._reused_offer() or self._export_payload(state.world, state.layout)
            state.offer = dataclasses.replace(offer, mode=self.mode)

    def _reused_offer(self) -> SliceOffer | None:
        """Step 2, rank 0 with ``reuse``: an offer that reads nothing, when the earlier start
        exited having served its slices for this fingerprint (None: export as usual). The
        commit then goes where that start read from."""
        earlier, fp = self._reuse, self._enter.fp
        if (
            earlier is None
            or fp is None
            or not earlier._exited
            or earlier._verdict.uncached is not None
            or earlier.report.fingerprint != fp.digest
            or earlier.report.layout != self._enter.layout
            or earlier.report.world_size != self._enter.world
        ):
            return None
        self.db = earlier.db
        self._served_ids = earlier._served_ids  # () after a cold start: no mark (a lower bound)
        readonly = earlier._verdict.readonly
        warnings = (
            (f"registry {earlier.report.registry} is read-only: this start commits nothing",)
            if readonly
            else ()
        )
        return SliceOffer(
            fp.digest,
            registry=earlier.report.registry,
            readonly=readonly,
            cache="reused",
            warnings=warnings,
            reused=True,
        )

    def _step_distribute(self) -> None:
        """3. One broadcast of rank 0's ``SliceOffer``. Every rank makes it, whatever step 1
        or 2 did (a rank 0 that could not export broadcasts the reason). Every rank, rank 0
        included, decodes the bytes that travelled, so a message that does not decode is
        the same reason on every rank and the confirm's branches stay the same everywhere.
        A rank whose broadcast failed holds an offer with the channel's error as reason,
        and its broken channel makes no further collective."""
        state, channel = self._enter, self._channel
        mine = _encoded(state.offer, "its slices") if state.rank == 0 else None
        data = channel.broadcast(mine)
        offer: SliceOffer
        if data is None:
            offer = SliceOffer(fingerprint=None, reason=channel.error or "no slice received")
        else:
            try:
                offer = SliceOffer.decode(data)
            except MalformedMessageError as exc:
                offer = SliceOffer(fingerprint=None, reason=str(exc))
        state.offer = offer
        # Rank 0's mode, so that no rank profiles where another only looks up.
        self.report.mode = offer.mode if data is not None and offer.mode in MODES else self.mode
        self.report.registry = offer.registry
        self.report.slice_cache = offer.cache
        self._verdict.readonly = offer.readonly
        for warning in offer.warnings:
            self._warn(warning)

    def _step_load(self) -> None:
        """4. Every rank whose fingerprint is rank 0's loads its slice, alone. No collective:
        a failed load is a value (``load_ok``, ``load_error``) for the confirm. The clear of
        step 1, when it was left to this step, is made here on every path, unless the tuner
        provably held exactly this slice already (``_load_texts``): a local decision that
        returns the same counts a load would, so the confirm cannot tell the two apart."""
        state = self._enter
        offer = state.offer
        assert offer is not None
        servable = offer.base is not None or offer.reused
        if state.local_error is None and servable and state.fp is not None:
            if offer.fingerprint == state.fp.digest:
                try:
                    state.loaded = self._load_reused() if offer.reused else self._load_slice(offer)
                    self.report.protocol_loaded = self._loaded.published
                    self.report.load_kept = self._loaded.kept
                except Exception as exc:  # noqa: BLE001 - a failed load is a value
                    state.load_ok = False
                    state.load_error = (
                        f"rank {state.rank} could not load its slice: {_one_line(exc)}"
                    )
        elif state.local_error is not None:
            state.load_ok, state.load_error = False, state.local_error
        if state.clear_pending:  # nothing was loaded: clear as step 1 would have
            state.clear_pending = False
            try:
                self.tuner.clear()
            except Exception as exc:  # noqa: BLE001 - a failed clear is a failed load
                if state.load_ok:
                    state.load_ok = False
                    state.load_error = (
                        f"rank {state.rank} could not set up its tuner: {_one_line(exc)}"
                    )

    def _step_confirm(self) -> None:
        """5. One all-gather of every rank's ``LoadConfirmation``; then, only when a load failed
        or fingerprints differ, one all-gather of ``LoadTrouble`` for the reason.

        Every branch below is decided on what every rank holds identically (the
        broadcast offer and the all-gathered confirmations), so every rank makes the
        second all-gather or none does. A rank whose all-gather failed has a broken
        channel and makes no further collective. Any reason found means every rank
        clears its tuner and tunes from empty.
        """
        state, channel, verdict = self._enter, self._channel, self._verdict
        offer = state.offer
        assert offer is not None
        mine = LoadConfirmation(
            int(state.load_ok),
            state.loaded,
            int(_cached_tuning_group(self.group) is not None),
            LoadConfirmation.digest_words(state.fp.digest if state.fp else None),
        )
        confirmations = self._decode_all(LoadConfirmation, channel.all_gather_ints(mine.encode()))
        if isinstance(confirmations, str):
            verdict.uncached = confirmations
        else:
            state.tuning_group_cached = all(c.tuning_group_cached for c in confirmations)
            verdict.uncached = offer.reason or self._confirm_reason(confirmations)
        if verdict.uncached is not None or isinstance(confirmations, str):
            verdict.no_commit = verdict.uncached
            if state.loaded:
                with suppress(Exception):
                    self.tuner.clear()
            state.loaded, self._loaded = 0, _Loaded()
            self.report.loaded_by_rank = [0] * state.world
        else:
            self.report.loaded_by_rank = [c.loaded for c in confirmations]
        self.report.loaded = state.loaded
        held_records = (
            sum(len(by_key) for by_key in self._loaded.records.values())
            if offer.reused
            else offer.record_count(state.rank)
        )
        self.report.records_loaded = held_records if verdict.uncached is None else 0
        if verdict.uncached is not None:
            self.report.protocol_loaded = 0

    def _confirm_reason(self, confirmations: list[LoadConfirmation]) -> str | None:
        """Why the ranks cannot use their slices (None: they can); may all-gather
        ``LoadTrouble``, on every rank alike (see ``_step_confirm``)."""
        state = self._enter
        differ = len({c.digest for c in confirmations}) > 1
        failed = not all(c.ok for c in confirmations)
        if differ or failed:
            trouble = LoadTrouble(state.fp.as_dict() if state.fp else None, state.load_error)
            details = self._decode_all(LoadTrouble, self._channel.all_gather(trouble.encode()))
            if isinstance(details, str):
                return details
            if differ:
                return "ranks run in different environments: " + _describe_difference(
                    [d.fields for d in details]
                )
            errors = [
                d.error or "a rank failed"
                for d, c in zip(details, confirmations, strict=True)
                if not c.ok
            ]
            more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
            return errors[0] + more
        if len({c.loaded for c in confirmations}) > 1:
            return (
                "ranks loaded different numbers of entries ("
                + ", ".join(str(c.loaded) for c in confirmations)
                + "); a rank that hits where another misses would stall synchronized tuning"
            )
        return None

    def _decode_all(self, kind: type[MsgT], received: list[Any] | None) -> list[MsgT] | str:
        """Every rank's message of ``kind`` from one all-gather, or why there are none: the
        channel's error (this rank's collective failed), or the decoding error (every rank
        read the same bytes, so every rank gets the same one)."""
        if received is None:
            return self._channel.error or "a collective failed"
        decode = cast(Any, kind).decode
        try:
            return [decode(item) for item in received]
        except MalformedMessageError as exc:
            return str(exc)

    def _step_v2_serve(self) -> None:
        """4b. v2 mode only, every rank alone: redirect ``autotune_v2`` to this rank's store for
        the block, and write and attach it now when eager (its slice, or empty). No
        collective; a failure is a failed load, which the confirm (step 5) makes every rank
        see: all clear, tune from empty and commit nothing."""
        mode, state = self._v2, self._enter
        if mode is None:
            return
        try:
            mode.serve(eager=self._v2_eager)
        except Exception as exc:  # noqa: BLE001 - a v2 problem never stops the server
            mode.end_block()
            why = f"rank {state.rank} could not serve its v2 store: {_one_line(exc)}"
            self._warn(why)
            if state.load_ok:
                state.load_ok, state.load_error = False, why
        for warning in mode.warnings:
            self._warn(warning)
        if mode.active:
            self.report.v2 = mode.report.as_json()

    def abandon(self) -> None:
        """Undo, on this rank only, what the start set up for its block (the autotune process
        group, v2 mode's ``autotune_v2`` redirect) without running the exit protocol: for a
        caller that leaves the start unclosed (``ficache.vllm_plugin``, when vLLM's own
        function raised while its peers may still be in vLLM's collectives). Never raises."""
        with suppress(Exception):
            self.tuner.set_process_group(None)
        if self._v2 is not None:
            with suppress(Exception):
                self._v2.end_block()

    @property
    def v2_cache_root(self) -> Path | None:
        """This rank's v2 store root in v2 mode (give it to ``autotune_v2(cache_root=...)``;
        any other root is sent there for the block anyway), else None."""
        return self._v2.root if self._v2 is not None else None

    def _step_tuning_group(self) -> None:
        """6. Set the tuning group (``_set_tuning_group``): when a dedicated group is created,
        ``new_group`` and one all-gather of ``TuningGroupCreated``, on every rank alike
        (``tuning_group_cached`` came from the confirm's all-gather). Skipped by a rank
        whose channel broke, which makes no further collective."""
        state = self._enter
        if state.world > 1 and self._channel.error is None and self.synchronize:
            self._set_tuning_group(state.tuning_group_cached)
            self.report.synchronized = self._tuning.group is not None

    def _load_slice(self, message: SliceOffer | CommitOutcome, *, final: bool = False) -> int:
        """Load the base text and this rank's overlay (``final``: step 9's, in place of what
        the tuner holds); return the entries now held."""
        assert message.base is not None
        texts = [message.base]
        overlay = message.overlay(self.report.rank)
        if overlay is not None:
            texts.append(overlay)
        return self._load_texts(texts, message.protocol, clear=final)

    def _load_reused(self) -> int:
        """Step 4 of a reused offer: load what the earlier start left this rank holding. A rank
        with no such start fails its load, so the confirm sends every rank uncached."""
        earlier = self._reuse
        if earlier is None or not earlier._exited or earlier._verdict.uncached is not None:
            raise FicacheError(
                "rank 0 reused its earlier start's slices and this rank has no such start "
                "(every rank of a group must pass warm_start(reuse=...) alike)"
            )
        return self._load_texts(list(earlier._loaded.texts), earlier._loaded.protocol_served)

    def _load_texts(
        self, texts: list[str], protocol: dict[str, dict[str, str]], *, clear: bool = False
    ) -> int:
        """Load the slice texts, then publish its protocol records (``Tuner.publish_protocol``,
        where the tuner has it); keep what the tuner then holds, to compare at exit.

        The tuner is cleared first when ``clear`` is set or step 1 left its clear here. A
        tuner that provably holds exactly what that clear and load would leave
        (``_kept_slice``) is neither cleared nor loaded, and the counts are those of the
        load that left it so; after a real clear and load, the tuner notes the slice
        (``Tuner.note_slice``) for a later start of this process."""
        self._loaded = _Loaded()
        clear = clear or self._enter.clear_pending
        kept = self._kept_slice(texts, protocol) if clear else None
        if kept is not None:
            loaded, published = kept
            self._loaded.texts, self._loaded.kept = list(texts), True
            self._enter.clear_pending = False
        else:
            if clear:
                self._enter.clear_pending = False
                self.tuner.clear()
            loaded = 0
            for text in texts:
                loaded += self.tuner.load(text)
                self._loaded.texts.append(text)
            publish = getattr(self.tuner, "publish_protocol", None)
            published = publish(protocol) if publish is not None and protocol else 0
            note = getattr(self.tuner, "note_slice", None)
            if clear and note is not None:
                note(texts, protocol, (loaded, published))
        if protocol and not published:
            self._warn(
                f"rank {self.report.rank}: {sum(len(b) for b in protocol.values())} protocol "
                "records not served: this FlashInfer has none (publish_protocol_record)"
            )
        self._loaded.protocol_served, self._loaded.published = protocol, published
        try:
            self._loaded.records, _skipped = self._held_records()
            held_protocol, _skipped = self._held_protocol()
        except Exception:  # noqa: BLE001 - then every record held at exit counts as new
            self._loaded.records, held_protocol = {}, {}
        # What was published is loaded, whatever identity FlashInfer filed it under.
        for ns, by_key in protocol.items():
            held_protocol[ns] = {**by_key, **held_protocol.get(ns, {})}
        self._loaded.protocol = held_protocol
        return loaded

    def _kept_slice(
        self, texts: list[str], protocol: dict[str, dict[str, str]]
    ) -> tuple[int, int] | None:
        """The counts of the load that left the tuner holding exactly ``texts`` and
        ``protocol``, when it provably still does (``Tuner.kept_slice``); None: clear and
        load. Never in v2 mode when the store is served from the load (eager or active)."""
        keep = getattr(self.tuner, "kept_slice", None)
        if keep is None or (self._v2 is not None and (self._v2_eager or self._v2.active)):
            return None
        try:
            return cast("tuple[int, int] | None", keep(texts, protocol))
        except Exception:  # noqa: BLE001 - then clear and load, as always
            return None

    def _export_payload(self, world: int, layout: str) -> SliceOffer:
        """Rank 0: what every rank needs to load its slice, or why there is nothing."""
        from ficache import location as registry_location
        from ficache.slices import cached_slices, export_slices

        fp = self._enter.fp
        if fp is None:
            return SliceOffer(None, reason="rank 0 could not collect its fingerprint")
        registry: str | None = None
        readonly = False
        fast = cached_slices(self.db, fp, layout, world) if self.slice_cache else None
        if fast is not None:
            slices, registry = fast
            # The warm path opened no registry: mark the SQLite file directly,
            # and tell a read-only file as ``Registry.open`` would.
            location = registry_location.resolve(self.db)
            with suppress(OSError):
                path = location.path
                readonly = path is not None and registry_location.is_read_only_file(path)
        else:

            def read() -> tuple[bool, Any]:
                with self._registry() as reg:
                    exported = export_slices(reg, fp, layout, world, use_cache=self.slice_cache)
                    return reg.readonly, exported

            try:
                # A server refusing connections for now (a restart storm) is asked again.
                with self._deadline():
                    readonly, slices = retry_transient(read, within=self.registry_timeout)
                registry = registry_location.resolve(self.db).display
            except FicacheError as exc:
                return SliceOffer(fp.digest, registry=registry, readonly=readonly, reason=str(exc))
            except Exception as exc:  # noqa: BLE001 - any registry problem means "uncached"
                return SliceOffer(
                    fp.digest,
                    registry=registry,
                    readonly=readonly,
                    reason=f"registry could not be read: {_one_line(exc)}",
                )
        self._served_ids = tuple(int(i) for i in slices.fingerprint_ids)
        warnings = list(slices.warnings)
        if readonly:
            warnings.append(f"registry {registry} is read-only: this start commits nothing")
        return SliceOffer(
            fp.digest,
            registry=registry,
            readonly=readonly,
            base=slices.base,
            overlays=tuple(slices.overlays),
            cache=slices.cache,
            warnings=tuple(warnings),
            record_counts=tuple(int(n) for n in slices.record_counts),
            protocol=slices.protocol,
        )

    def _set_tuning_group(self, alive: bool) -> None:
        group = self.group
        dedicated = dist.get_world_size(group) == dist.get_world_size()
        chosen: Any = group
        if dedicated:
            if alive:
                chosen = _cached_tuning_group(group)
            else:
                _drop_tuning_group(group)
                created, error = None, None
                try:
                    created = dist.new_group(
                        backend="gloo",
                        timeout=datetime.timedelta(seconds=self.timeout),
                        group_desc="ficache_tuning",
                    )
                except Exception as exc:  # noqa: BLE001
                    error = _one_line(exc)
                answers = self._decode_all(
                    TuningGroupCreated,
                    self._channel.all_gather(TuningGroupCreated(error is None).encode()),
                )
                oks = None if isinstance(answers, str) else [a.ok for a in answers]
                if oks is not None and all(oks) and created is not None:
                    _TUNING_GROUPS[id(group)] = (group, created)
                    chosen = created
                else:
                    if created is not None:
                        with suppress(Exception):
                            dist.destroy_process_group(created)
                    self._warn(
                        f"could not create a tuning group ({error or 'on another rank'}); tuning on the caller's group"
                    )
                    dedicated = False
                    if self._channel.error is not None:
                        return
        try:
            self.tuner.set_process_group(chosen)
        except Exception as exc:  # noqa: BLE001
            self._warn(f"could not set the autotune process group: {_one_line(exc)}")
            return
        self._tuning.group = chosen
        self._tuning.dedicated = dedicated

    # -- exit -------------------------------------------------------------

    def _release(self) -> None:
        """Close the dedicated tuning group now (see the module docstring)."""
        tuning = self._tuning
        if tuning.released:
            return
        tuning.released = True
        with suppress(Exception):
            self.tuner.set_process_group(None)
        if tuning.dedicated:
            _drop_tuning_group(self.group)
            tuning.group = None

    def _new_entries(self) -> dict[str, Row]:
        tuned = self.tuner.tuned()
        if not tuned:
            return {}
        loaded: dict[str, Any] = {}
        for text in self._loaded.texts:
            loaded.update(json.loads(text))
        new: dict[str, Row] = {}
        for key, row in tuned.items():
            old = loaded.get(key)
            if isinstance(old, list) and len(old) in (2, 3, 4):
                policy = canonical_json(old[2]) if len(old) >= 3 else None
                if (old[0], canonical_json(old[1]), policy) == row_value(row):
                    continue
            new[key] = row
        return new

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        state = _ExitState(exc=exc, failed_at=time.time())
        t = self._phase("block", self._clock.block_started)
        for phase, step in self.EXIT_STEPS:
            getattr(self, step)(state)
            if phase is not None:
                t = self._phase(phase, t)
        self._mark_start()
        self._finish(state.outcome, exc)
        self._exited = True

    def _step_read_tuner(self, state: _ExitState) -> None:
        """7. Every rank, alone: close the replay block (replay mode: ``report.missed``),
        clear the tuning group (release it at once if the block raised), then read what it
        holds that is new (in replay mode, reported and then dropped: nothing is gathered
        or committed). No collective; a tuner that cannot be read is a value
        (``tuner_error``) for the exchange."""
        rank = self.report.rank
        self._close_replay()
        with suppress(Exception):
            self.tuner.set_process_group(None)
        if self._v2 is not None:
            self._v2.end_block()
        if state.exc is not None:
            tuning = self._tuning
            _drop_frame_references(state.exc, tuning.group if tuning.dedicated else None)
            self._release()
        try:
            state.new = self._new_entries()
            state.new_records, skipped_records = self._new_records()
            if skipped_records:
                self._warn(
                    f"rank {rank}: {skipped_records} namespaced records JSON cannot carry "
                    "exactly; not stored"
                )
            state.new_protocol, skipped_protocol = self._new_protocol()
            if skipped_protocol:
                self._warn(
                    f"rank {rank}: {skipped_protocol} protocol records ficache cannot store "
                    "exactly; not stored"
                )
        except Exception as exc2:  # noqa: BLE001
            state.tuner_error = f"rank {rank} could not read its tuner: {_one_line(exc2)}"
        self.report.tuned = len(state.new)
        self.report.records_tuned = sum(len(by_key) for by_key in state.new_records.values())
        self.report.protocol_tuned = sum(len(by_key) for by_key in state.new_protocol.values())
        if self._v2 is not None and self._v2.active:
            for warning in self._v2.warnings:
                self._warn(warning)
            self.report.v2 = self._v2.report.as_json()
        if self._replay is not None:
            if state.new or state.new_records or state.new_protocol:
                self._warn(
                    f"rank {rank}: replay mode: {len(state.new)} entries, "
                    f"{self.report.records_tuned} records and {self.report.protocol_tuned} "
                    "protocol records produced in the block are not committed"
                )
            # replay commits nothing (no step 9)
            state.new, state.new_records, state.new_protocol = {}, {}, {}

    # -- replay mode ------------------------------------------------------

    def _open_replay(self) -> None:
        """End of enter, every rank in replay mode, alone: open the tuner's replay block
        (``Tuner.replay``: FlashInfer never profiles in it, misses are recorded). A tuner
        without one, or one that fails to open, is a warning: it may profile, and replay
        commits nothing anyway (step 7)."""
        self._replay = _Replay()
        replay = getattr(self.tuner, "replay", None)
        if replay is None:
            self._warn(
                "replay mode: this tuner cannot replay, so it may profile; nothing is committed"
            )
            return
        try:
            guard = replay()
            self._replay = _Replay(guard, guard.__enter__())
        except Exception as exc:  # noqa: BLE001 - the start goes on, committing nothing
            self._warn(f"replay mode: could not enter it ({_one_line(exc)}); nothing is committed")

    def _close_replay(self) -> None:
        """Step 7, replay mode: close the replay block; ``report.missed`` is its misses."""
        replay = self._replay
        if replay is None or replay.guard is None:
            return
        guard, replay.guard = replay.guard, None
        try:
            guard.__exit__(None, None, None)
        except Exception as exc:  # noqa: BLE001
            self._warn(f"replay mode: could not leave it cleanly: {_one_line(exc)}")
        self.report.missed = len(getattr(replay.lookups, "missed", ()))

    def _mark_misses(self) -> int | None:
        """What the served mark counts as this start's misses: None for a tune start."""
        return self.report.missed if self._replay is not None else None

    def _mark_start(self) -> None:
        """After step 9, rank 0: the served mark (``ficache.usage.mark_served``), counting
        this start and, in replay mode, its misses, now that the block ran: one UPDATE per
        start, bounded and never raising, and only when the ranks used their slices. On a
        SQLite file it is written on a thread of its own (``mark_served_after_start``), so
        the start returns before its fsyncs. A
        start whose commit met the registry failing (a full disk, a lost server) leaves no
        mark either: the registry stays exactly as it was, and the counts stay a lower
        bound (``ficache.usage``)."""
        verdict = self._verdict
        if (
            self.report.rank != 0
            or not self._served_ids
            or verdict.uncached is not None
            or verdict.commit_failed
        ):
            return
        from ficache.location import resolve
        from ficache.usage import mark_served, mark_served_after_start

        try:
            location = resolve(self.db)
            if location.path is not None:  # off the start's path: no rank waits for its fsyncs
                mark_served_after_start(location, self._served_ids, missed=self._mark_misses())
                return
            with self._deadline(), self._registry() as reg:
                mark_served(reg, self._served_ids, missed=self._mark_misses())
        except Exception as exc:  # noqa: BLE001 - the mark never fails a start
            logger.debug("ficache: the start's served mark was skipped: %s", _one_line(exc))

    def _step_exchange(self, state: _ExitState) -> None:
        """8. One all-gather of every rank's ``StatusReport`` (the status exchange), made by
        every rank whatever its block did. A rank that waits ``release_grace`` for its
        peers releases the tuning group, so a peer stuck in a tuning all-reduce fails at
        once and reaches this exchange too. A block that raised because a tuning
        collective waited out the timeout has waited for its peers once already: it waits
        only ``release_grace`` more, so a stalled peer costs the timeout once. On a failed
        exchange (or statuses that do not decode, the same on every rank) ``statuses``
        stays None and this rank makes no further collective."""
        report, channel = self.report, self._channel
        exc = state.exc
        waited_out = exc is not None and "timed out" in str(exc).lower()
        status = StatusReport(
            int(state.raised),
            len(state.new),
            int(state.tuner_error is not None),
            report.records_tuned,
            report.protocol_tuned,
        )
        statuses = self._decode_all(
            StatusReport,
            channel.exchange(
                status.encode(),
                self.release_grace,
                self.release_grace if waited_out else self.timeout,
                self._release,
            ),
        )
        if isinstance(statuses, str):
            self._verdict.rank_failed = True
            self._release()
            self._verdict.no_commit = self._verdict.no_commit or statuses
            report.tuned_by_rank = [len(state.new)]
        else:
            state.statuses = statuses
            report.tuned_by_rank = [s.new_entries for s in statuses]
            self._verdict.anyone_tuned = any(s.tuned_any for s in statuses)

    def _step_share_failures(self, state: _ExitState) -> None:
        """8b. Only when a status says a rank raised or cannot read its tuner (every rank
        holds the same statuses, so all make it or none): one all-gather of
        ``FailureNote``, so every rank names the same root cause; nothing is committed."""
        statuses = state.statuses
        if statuses is None or not any(s.failed for s in statuses):
            return
        report, verdict = self.report, self._verdict
        verdict.rank_failed = True
        if any(s.raised for s in statuses):
            self._release()
        mine = FailureNote()
        if state.exc is not None:
            mine = FailureNote(
                state.failed_at,
                f"rank {report.rank} raised {_one_line(state.exc)} in the warm-start block",
            )
        elif state.tuner_error is not None:
            mine = FailureNote(state.failed_at, state.tuner_error)
        notes = self._decode_all(FailureNote, self._channel.all_gather(mine.encode()))
        if isinstance(notes, str) and self._channel.error is None:
            verdict.no_commit = verdict.no_commit or notes  # undecodable, on every rank
            return
        heard = [mine] if isinstance(notes, str) else notes
        messages = sorted((n.at, n.message) for n in heard if n.at is not None and n.message)
        first = messages[0][1] if messages else "a rank failed"
        more = f" (then {len(messages) - 1} more rank(s) failed)" if len(messages) > 1 else ""
        verdict.no_commit = verdict.no_commit or first + more

    def _step_commit(self, state: _ExitState) -> None:
        """9. Only when a status says a rank tuned something (the same statuses everywhere, so
        every rank goes on or none does): ``_commit_phase``. Otherwise every rank already
        knows the outcome: nothing to commit."""
        statuses = state.statuses
        if statuses is not None and any(s.tuned_any for s in statuses):
            state.outcome = self._commit_phase(
                state.new, statuses, state.new_records, state.new_protocol
            )

    def _commit_phase(
        self,
        new: dict[str, Row],
        statuses: list[StatusReport],
        new_records: dict[str, dict[str, str]] | None = None,
        new_protocol: dict[str, dict[str, str]] | None = None,
    ) -> CommitOutcome | None:
        """9a-b. One gather of every rank's ``TunedResults`` to rank 0, which commits
        (``_commit``, never raises, bounded by ``registry_timeout``), then one broadcast of
        rank 0's ``CommitOutcome``; every rank loads its final slice from it. A rank 0 whose
        gather failed broadcasts nothing (its channel is broken); its peers then report the
        outcome as unknown or nothing committed, never a commit that did not happen."""
        channel, report, verdict = self._channel, self.report, self._verdict
        t = time.perf_counter()
        mine_tuned = TunedResults(new, new_records or {}, new_protocol or {})
        gathered = channel.gather(_encoded(mine_tuned, "what it tuned"))
        t = self._phase("gather", t)
        outcome: CommitOutcome | None = None
        if report.rank == 0 and gathered is not None:
            outcome = self._commit(self._decode_tuned(gathered))
            t = self._phase("commit", t)
        data = channel.broadcast(_encoded(outcome, "the outcome") if outcome is not None else None)
        mine: CommitOutcome | None = None
        why = channel.error or "no outcome received"
        if data is not None and outcome is not None:
            mine = outcome  # rank 0: what it sent, not decoded back
        elif data is not None:
            try:
                mine = CommitOutcome.decode(data)
            except MalformedMessageError as exc:
                why = str(exc)
        if mine is None and outcome is not None:
            # The commit is made (or failed) whatever a peer heard of it: report it as it is.
            self._warn(f"the outcome did not reach every rank: {channel.error}")
            mine = outcome
        if mine is None:
            if report.rank != 0 and gathered is not None and verdict.no_commit is None:
                # This rank's entries reached rank 0, which may have committed
                # them before its answer was lost: "nothing committed" could be false.
                verdict.outcome_unknown = why
            else:
                verdict.no_commit = verdict.no_commit or why
            return None
        if mine.base is not None:
            try:
                self._load_slice(mine, final=True)
            except Exception as exc:  # noqa: BLE001 - the tuner keeps what it tuned
                self._warn(f"rank {report.rank} could not load its final slice: {_one_line(exc)}")
        self._phase("final", t)
        return mine

    def _decode_tuned(self, gathered: list[Any]) -> list[TunedResults | None]:
        """Rank 0: every rank's ``TunedResults``; a rank's that does not decode is None, and
        the reason nothing may be committed."""
        out: list[TunedResults | None] = []
        for r, data in enumerate(gathered):
            try:
                out.append(TunedResults.decode(data))
            except MalformedMessageError as exc:
                verdict = self._verdict
                verdict.no_commit = verdict.no_commit or f"{exc} (from rank {r})"
                out.append(None)
        return out

    def _commit(self, gathered: list[TunedResults | None]) -> CommitOutcome:
        """Rank 0: classify, commit once, export the final slices. Never raises.

        Concurrent servers: the value already committed wins. When another
        server of the same fingerprint committed a key (same scope) between
        this start's export and its commit, with a different value, this
        commit keeps the stored value (``Registry.write(keep_existing=True)``,
        decided under the registry's write lock): the later value is not
        written, and is counted in ``report.kept``. The final slices every
        rank loads come from the registry after the commit, so all ranks of
        this server, and every later start, use the one stored value, and a
        fleet restarting together converges instead of flipping tactics.
        Both values were tuned on the same fingerprint; the first to commit
        is already served, so keeping it never changes a running server's
        tactic behind its back.
        """
        verdict = self._verdict
        result: dict[str, Any] = {
            "reason": verdict.no_commit,
            "committed": 0,
            "commit_id": None,
            "shared": 0,
            "scoped": 0,
            "disagreements": 0,
            "kept": 0,
            "warnings": [],
        }
        per_rank: list[dict[str, Row]] = [dict(g.entries) if g else {} for g in gathered]
        synchronized = self.report.synchronized and verdict.no_commit is None
        world, layout = self.report.world_size, self.report.layout
        shared, scoped = startup_commit.classify_entries(per_rank, world, synchronized, result)
        records = startup_commit.classify_records(
            [g.records if g else None for g in gathered], world, layout, synchronized, result
        )
        protocol = startup_commit.classify_protocol(
            [g.protocol if g else None for g in gathered], result
        )
        result["shared"], result["scoped"] = len(shared), len(scoped)
        if verdict.no_commit is None and verdict.readonly:
            verdict.no_commit = f"registry {self.report.registry} is read-only"
        fp = self._enter.fp
        if (
            verdict.no_commit is None
            and fp is not None
            and (shared or scoped or records or protocol)
        ):
            contents = startup_commit.StartupContents(shared, scoped, records, protocol)
            self._write_commit(fp, per_rank, contents, synchronized, result)
        result["reason"] = verdict.no_commit
        if verdict.no_commit is not None:
            result["shared"] = result["scoped"] = 0
        result["warnings"] = tuple(result["warnings"])
        return CommitOutcome(**result)

    def _write_commit(
        self,
        fp: Fingerprint,
        per_rank: list[dict[str, Row]],
        contents: startup_commit.StartupContents,
        synchronized: bool,
        result: dict[str, Any],
    ) -> None:
        """Rank 0: the one startup commit, retried after refusals for now within
        ``registry_timeout`` and cut at it; its counts and the final slices go to ``result``,
        a failure to ``verdict.no_commit``. The commit carries a fresh token
        (``Registry.write(once_token=...)``): a retry after a connection lost mid-COMMIT
        finds, under the write lock, the commit that landed after all, so it never lands twice."""
        write = self._startup_write(fp, per_rank, contents, synchronized, result)
        verdict = self._verdict
        verdict.commit_failed = True  # until the write returns
        try:
            with self._deadline():
                startup_commit.count_written(
                    retry_transient(write, within=self.registry_timeout), result
                )
                verdict.commit_failed = False
                self._export_final(fp, result)
        except RegistryTimeoutError as exc:
            verdict.no_commit = (
                f"commit failed: {exc}; if the server had received the commit before it "
                "stopped answering, it lands when the server resumes, whole"
            )
        except RegistryBusyError as exc:  # it says how long the commit waited
            verdict.no_commit = f"commit failed: {exc}; nothing was written"
        except FicacheError as exc:
            verdict.no_commit = f"commit failed: {exc}"
        except Exception as exc:  # noqa: BLE001 - a failed commit leaves the registry as it was
            verdict.no_commit = f"commit failed: {_one_line(exc)}"

    def _startup_write(
        self,
        fp: Fingerprint,
        per_rank: list[dict[str, Row]],
        contents: startup_commit.StartupContents,
        synchronized: bool,
        result: dict[str, Any],
    ) -> Callable[[], WriteResult]:
        """Rank 0: the startup commit as one call that may be retried: it opens the registry,
        refuses a read-only one or a schema it may not write, and writes under a token of
        this start (a retry looks it up first)."""
        world, layout = self.report.world_size, self.report.layout
        entries, provenance, message = startup_commit.commit_contents(
            fp,
            per_rank,
            contents,
            world=world,
            layout=layout,
            synchronized=synchronized,
            disagreements=result["disagreements"],
            provenance=self.provenance,
        )
        if self._v2 is not None and self._v2.active:
            provenance["v2_mode"] = self._v2.report.as_json()
            provenance.update(self._v2.environments_provenance(fp.digest))
        token = uuid.uuid4().hex
        attempts = 0

        def write() -> WriteResult:
            nonlocal attempts
            attempts += 1
            with self._registry() as reg:
                if reg.readonly:
                    raise RegistryReadOnlyError(f"registry {reg.location.display} is read-only")
                reg.require_writable()  # a newer schema only older readers may use
                return reg.write(
                    entries,
                    kind="startup",
                    world_size=world,
                    layout=layout,
                    provenance=provenance,
                    message=message,
                    keep_existing=True,
                    once_token=token,
                    token_is_new=attempts == 1,  # a retry looks the token up first
                    records=[
                        NewRecord(fp, ns, key, value, scope)
                        for scope, ns, key, value in contents.records
                    ],
                    protocol_records=[
                        NewProtocolRecord(fp, ns, key, value)
                        for ns, key, value in contents.protocol
                    ],
                )

        return write

    def _export_final(self, fp: Fingerprint, result: dict[str, Any]) -> None:
        """Rank 0, after its commit: the final slices (the registry's state after it) into
        ``result``; a failure is a warning, and every rank keeps what it holds."""
        from ficache.slices import export_slices

        report = self.report
        try:
            with self._registry() as reg:
                final = export_slices(
                    reg,
                    fp,
                    report.layout,
                    report.world_size,
                    use_cache=self.slice_cache,
                    for_tuning=False,
                )
            result.update(base=final.base, overlays=tuple(final.overlays), protocol=final.protocol)
        except Exception as exc:  # noqa: BLE001 - ranks keep what they hold
            result["warnings"].append(f"could not export the final slices: {_one_line(exc)}")

    def _new_records(self) -> tuple[dict[str, dict[str, str]], int]:
        """Records the tuner holds that differ from what it held after the load, as
        canonical JSON, and how many it holds that JSON cannot carry exactly (skipped)."""
        held, skipped = self._held_records()
        return _changed(held, self._loaded.records), skipped

    def _new_protocol(self) -> tuple[dict[str, dict[str, str]], int]:
        """Protocol records the tuner holds that differ from what it held after the load
        (published during the block), as ``_new_records``."""
        held, skipped = self._held_protocol()
        return _changed(held, self._loaded.protocol), skipped

    def _held_records(self) -> tuple[dict[str, dict[str, str]], int]:
        """The records the tuner holds, as canonical JSON, and how many JSON cannot carry."""
        read = getattr(self.tuner, "records", None)
        return _canonical_held(read() if read is not None else {}, _check_record_identity)

    def _held_protocol(self) -> tuple[dict[str, dict[str, str]], int]:
        """The protocol records the tuner holds (``Tuner.protocol_records``, where it has it),
        as canonical JSON, and how many ficache cannot store exactly."""
        read = getattr(self.tuner, "protocol_records", None)
        return _canonical_held(read() if read is not None else {}, check_protocol_identity)

    def _finish(self, outcome: CommitOutcome | None, exc: BaseException | None) -> None:
        """After the exit steps, every rank alone: take rank 0's outcome, judge the start
        (status and reason, from data every rank holds alike), log it."""
        if outcome is not None:
            self._take_outcome(outcome)
        self._judge()
        self._phase("total", self._clock.started)
        self._log_finished()

    def _take_outcome(self, outcome: CommitOutcome) -> None:
        report = self.report
        report.committed = outcome.committed
        report.commit_id = outcome.commit_id
        report.shared = outcome.shared
        report.scoped = outcome.scoped
        report.disagreements = outcome.disagreements
        report.kept = outcome.kept
        report.records_committed = outcome.records_committed
        report.protocol_committed = outcome.protocol_committed
        for warning in outcome.warnings:
            self._warn(warning)
        self._verdict.no_commit = outcome.reason or self._verdict.no_commit

    def _judge(self) -> None:
        """``report.status`` and ``report.reason``: "uncached", else "cold" (nothing loaded),
        "partial" (a rank held something new) or "warm"; the reason nothing was committed."""
        report, verdict = self.report, self._verdict
        tuned_any = (
            verdict.anyone_tuned
            or any(report.tuned_by_rank)
            or report.tuned > 0
            or report.records_tuned > 0
            or report.protocol_tuned > 0
        )
        if verdict.uncached is not None:
            report.status = "uncached"
            report.reason = verdict.uncached
            return
        if not (any(report.loaded_by_rank) or report.records_loaded or report.protocol_loaded):
            report.status = "cold"
        elif tuned_any:
            report.status = "partial"
        else:
            report.status = "warm"
        if verdict.no_commit is not None and (tuned_any or verdict.rank_failed):
            report.reason = f"nothing committed: {verdict.no_commit}"
        elif verdict.outcome_unknown is not None:
            report.reason = (
                f"commit outcome unknown: {verdict.outcome_unknown}; rank 0 may have "
                "committed (see `ficache log`)"
            )

    def _log_finished(self) -> None:
        report = self.report
        if report.reason and self._verdict.uncached is None:
            logger.warning(
                "ficache warm start rank %d/%d: %s", report.rank, report.world_size, report.reason
            )
        for warning in report.warnings:
            logger.warning(
                "ficache warm start rank %d/%d: %s", report.rank, report.world_size, warning
            )
        logger.info(
            "ficache warm start rank %d/%d (%s): %s; loaded %d, tuned %d, committed %d (commit %s), "
            "%d disagreements%s, %.3f s",
            report.rank,
            report.world_size,
            report.layout,
            report.status,
            report.loaded,
            report.tuned,
            report.committed,
            report.commit_id,
            report.disagreements,
            f", replay: missed {report.missed}" if report.mode == "replay" else "",
            report.total_seconds,
        )


#: The public name: ``with ficache.warm_start(group, ...) as ws:`` (see ``WarmStart``).
warm_start = WarmStart
