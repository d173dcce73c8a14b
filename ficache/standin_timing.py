"""A CPU STAND-IN for CUDA timing, so FlashInfer's REAL tuning loop runs on a CPU.

``ficache.standin`` replaces FlashInfer's whole profiling loop. This module
replaces much less: only what times a kernel on a GPU. Everything else of
``AutoTuner.choose_one`` runs as FlashInfer wrote it, on a real gloo group:
the profile generation, the cache lookups, the out-of-memory flags it
all-reduces across the tuning group (``_sync_oom_across_tune_group``: after
input preparation and after each runner's preparation), the per-tactic
timing all-reduce in ``_profile_single_kernel`` (including its
"reduce ``inf`` and re-raise" path when a tactic fails on one rank), the
fallback to ``runners[0], -1`` when any rank ran out of memory, and, in
FlashInfer 0.7.4+, the group agreement gates (operation, profiles, cache
hits, candidates). So a deadlock that FlashInfer's own collective sequence
could cause shows on a CPU, under the hard timeout of the test that runs it.

What is replaced, and why (``cpu_timing``):

- The ``torch.cuda`` namespace *as seen by* ``flashinfer.autotuner.autotuner``
  (the module's ``torch`` global is swapped for a proxy whose ``cuda``
  attribute is ``_CpuCudaTiming``; every other ``torch`` attribute is the
  real one, and no other module sees the proxy). Its members:
  ``Event`` (records ``time.perf_counter`` plus the stand-in clock's
  charged time, ``elapsed_time`` in ms), ``current_stream`` / ``stream``
  (a stream whose ``synchronize`` does nothing: CPU work is synchronous),
  ``CUDAGraph`` (inert; ``graph`` raises: CUDA-graph timing is not
  imitated), ``is_current_stream_capturing`` and ``is_initialized``
  (False: no capture, no CUDA context, which is what CPU-only torch cannot
  answer without raising), ``synchronize`` and ``empty_cache`` (no-ops).
  ``OutOfMemoryError`` and every other name are torch's own.
  Why that seam: ``_profile_single_kernel`` takes its timings from CUDA
  events inside nested functions (no narrower hook exists), and it issues
  the timing all-reduce itself. Replacing ``_profile_single_kernel`` would
  replace that all-reduce and its failure handling too, which are exactly
  what must stay real.
- ``AutoTuner.stream_delay_micro_secs`` is 0 for the block (FlashInfer's own
  knob): the delay is a CUDA kernel queued before the timed launches to hide
  host overhead on a GPU stream; there is no stream to delay on a CPU.
- The timer must be CUDA events: ``FLASHINFER_AUTOTUNE_TIMER=globaltimer``
  (a GPU kernel) is refused.

What the stand-in times: ``HookedStandInRunner``, the stand-in op's five CPU
matmul variants (``ficache.standin``'s runner class name and keys: entries
are the same ``file_key`` strings ``standin_tune`` produces).
``real_loop_tune`` makes one ``choose_one`` call per weight shape, under
FlashInfer's ``autotune(True)``, so FlashInfer itself generates and profiles
every ``M`` bucket. Test hooks (``Faults``), named as such: ``skew`` charges
extra time to tactics on this rank only (ranks whose own timings disagree),
``fail_tactic`` makes a tactic raise on this rank, and ``oom_shape`` makes
this rank run out of memory (``MemoryError``) preparing the runner for one
weight shape, which FlashInfer all-reduces as an OOM flag.

Instrumentation, not a fake: while installed, ``torch.distributed.all_reduce``
is wrapped by a pass-through counter (``LoopResult.reduces``).

Invariants: ``cpu_timing`` restores the module's ``torch``, the delay and
``torch.distributed.all_reduce`` on exit, also when the block raises; it
never touches a GPU, and it is not re-entrant (a nested use raises).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from types import ModuleType
from typing import Any

import torch
import torch.distributed as dist
from flashinfer.autotuner import (
    AutoTuner,
    autotune,
    get_autotune_process_group,
    set_autotune_process_group,
)

from ficache.standin import (
    CONFIG,
    DEFAULT_BUCKETS,
    DEFAULT_SHAPES,
    STANDIN_OP,
    CpuStandInMatmulRunner,
)

AUTOTUNER_MODULE = "flashinfer.autotuner.autotuner"

_state = threading.local()
_installed = threading.Lock()


def _charged_ms() -> float:
    return float(getattr(_state, "charged_ms", 0.0))


def charge(ms: float) -> None:
    """Add ``ms`` to the stand-in clock (what a slower kernel would have cost)."""
    _state.charged_ms = _charged_ms() + ms


class _CpuEvent:
    """Stand-in for ``torch.cuda.Event(enable_timing=True)``: a CPU clock reading."""

    def __init__(self, enable_timing: bool = False, **_: Any) -> None:
        self.at_ms: float | None = None

    def record(self, stream: Any = None) -> None:
        self.at_ms = time.perf_counter() * 1e3 + _charged_ms()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _CpuEvent) -> float:
        if self.at_ms is None or end.at_ms is None:
            raise RuntimeError("stand-in event: both events must be recorded first")
        return end.at_ms - self.at_ms


class _CpuStream:
    """Stand-in for a CUDA stream: CPU work is done when the call returns."""

    def synchronize(self) -> None:
        pass

    def wait_stream(self, other: Any) -> None:
        pass


class _InertGraph:
    """Stand-in for ``torch.cuda.CUDAGraph()``, which ``pure_profile`` builds even unused."""

    def replay(self) -> None:
        raise RuntimeError("the CPU timing stand-in does not imitate CUDA graphs")


class _CpuCudaTiming:
    """The ``torch.cuda`` that FlashInfer's autotuner module sees under ``cpu_timing``."""

    Event = _CpuEvent
    CUDAGraph = _InertGraph
    _stream = _CpuStream()

    def current_stream(self, device: Any = None) -> _CpuStream:
        return self._stream

    def stream(self, stream: Any) -> contextlib.AbstractContextManager[None]:
        return contextlib.nullcontext()

    def graph(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("the CPU timing stand-in does not imitate CUDA graphs")

    def is_current_stream_capturing(self) -> bool:
        return False

    def is_initialized(self) -> bool:
        return False

    def is_available(self) -> bool:
        return False

    def synchronize(self, device: Any = None) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def __getattr__(self, name: str) -> Any:  # OutOfMemoryError, Stream, ...: torch's own
        return getattr(torch.cuda, name)


class _TorchWithCpuTiming(ModuleType):
    """``torch`` for the autotuner module: the real one, except ``cuda``."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CpuCudaTiming()

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


@dataclass
class CollectiveCount:
    """All-reduces issued (by FlashInfer) while ``cpu_timing`` was installed."""

    all_reduces: int = 0


@contextlib.contextmanager
def cpu_timing() -> Iterator[CollectiveCount]:
    """Run FlashInfer's real tuning loop with CUDA timing replaced by the CPU stand-in.

    Yields a ``CollectiveCount`` of the all-reduces issued inside the block
    (counted by a pass-through wrapper around ``torch.distributed.all_reduce``;
    the block is the tuning loop, so they are FlashInfer's).
    """
    if os.environ.get("FLASHINFER_AUTOTUNE_TIMER", "").lower() == "globaltimer":
        raise RuntimeError("cpu_timing stands in for CUDA events, not FlashInfer's globaltimer")
    if not _installed.acquire(blocking=False):
        raise RuntimeError("cpu_timing is already installed (it is not re-entrant)")
    try:
        namespace = vars(importlib.import_module(AUTOTUNER_MODULE))
        tuner = AutoTuner.get()
        if getattr(tuner, "_use_global_timer", False):
            raise RuntimeError("the AutoTuner times with globaltimer; cpu_timing needs events")
        count = CollectiveCount()
        real_all_reduce = dist.all_reduce

        def counted_all_reduce(*args: Any, **kwargs: Any) -> Any:
            count.all_reduces += 1
            return real_all_reduce(*args, **kwargs)

        saved_torch, saved_delay = namespace["torch"], tuner.stream_delay_micro_secs
        namespace["torch"] = _TorchWithCpuTiming()
        tuner.stream_delay_micro_secs = 0
        dist.all_reduce = counted_all_reduce
        _state.charged_ms = 0.0
        try:
            yield count
        finally:
            dist.all_reduce = real_all_reduce
            namespace["torch"] = saved_torch
            tuner.stream_delay_micro_secs = saved_delay
            _state.charged_ms = 0.0
    finally:
        _installed.release()


@dataclass(frozen=True)
class Faults:
    """This rank's test hooks for ``real_loop_tune`` (hashable: part of the runner's hash)."""

    skew: tuple[tuple[int, float], ...] = ()  # (tactic, ms charged per call on this rank)
    fail_tactic: int | None = None  # this tactic raises on this rank
    oom: bool = False  # preparing the runner runs out of memory on this rank


class HookedStandInRunner(CpuStandInMatmulRunner):
    """The stand-in op's runner with this rank's ``Faults`` (fault injection, named as such).

    Its class name is the stand-in runner's, so its entries have the very
    ``file_key`` strings ``standin_tune`` produces; its hash (FlashInfer keys
    its in-memory winners by it) depends only on ``rank_tag`` and ``faults``.
    """

    def __init__(self, rank_tag: str | None = None, faults: Faults = Faults()) -> None:
        super().__init__(rank_tag)
        self.faults = faults

    def get_valid_tactics(self, inputs: list[torch.Tensor], profile: Any) -> list[int]:
        if self.faults.oom:
            raise MemoryError("injected out-of-memory preparing the runner")
        return super().get_valid_tactics(inputs, profile)

    def forward(
        self,
        inputs: list[torch.Tensor],
        tactic: Any = -1,
        do_preparation: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        if self.faults.fail_tactic is not None and tactic == self.faults.fail_tactic:
            raise RuntimeError(f"injected failure of tactic {tactic}")
        out = super().forward(inputs, tactic=tactic, do_preparation=do_preparation, **kwargs)
        for skewed, ms in self.faults.skew:
            if tactic == skewed:
                charge(ms)
        return out


HookedStandInRunner.__name__ = HookedStandInRunner.__qualname__ = CpuStandInMatmulRunner.__name__


def _held(
    tuner: Any, runner: CpuStandInMatmulRunner, k: int, n: int, buckets: Sequence[int]
) -> int:
    """How many buckets of ``(K, N)`` the AutoTuner already holds (loaded or tuned)."""
    held = 0
    b = torch.empty(k, n)
    for m in buckets:
        hit, *_ = tuner.search_cache(
            STANDIN_OP, [runner], ((m, k), (k, n)), CONFIG, inputs=[torch.empty(m, k), b]
        )
        held += bool(hit)
    return held


def _winners(tuner: Any) -> set[Any]:
    """The keys the AutoTuner holds a winner for that it profiled, under any identity: in
    ``profiling_cache`` (v1) and in its winner partitions (under ``autotune_v2`` new winners
    go to the managed store's partition, not to ``profiling_cache``). A winner promoted
    from a store or a file carries no profile (``(tactic, None)``) and is not counted."""
    caches = [tuner.profiling_cache, *getattr(tuner, "_winner_partitions", {}).values()]
    return {
        key
        for cache in caches
        for key, value in list(cache.items())
        if isinstance(value, tuple) and len(value) == 2 and value[1] is not None
    }


@dataclass(frozen=True)
class LoopResult:
    """What one ``real_loop_tune`` call did on this rank."""

    profiled: int  # keys FlashInfer's loop profiled and cached (v1 or v2: see ``_winners``)
    hits: int  # keys the AutoTuner held before (loaded or tuned), of those asked for
    reduces: int  # all-reduces FlashInfer issued (OOM flags, timings, agreement gates)
    fallbacks: int  # choose_one calls that returned the fallback (runners[0], -1)
    seconds: float


def real_loop_tune(
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    rank_tag: str | None = None,
    sync: bool = True,
    skew: dict[int, float] | None = None,
    fail_tactic: int | None = None,
    oom_shape: int | None = None,
) -> LoopResult:
    """Tune the stand-in op through FlashInfer's real ``choose_one``, one call per ``(K, N)``.

    Each call runs under ``autotune(True)`` with an ``M`` of the largest
    bucket, so FlashInfer profiles every bucket of ``buckets`` (which must be
    the stand-in's ``DEFAULT_BUCKETS``: the tuning config is fixed) that it
    does not hold. ``sync=False`` clears the autotune process group for the
    call (independent tuning) and restores it afterwards.
    """
    if tuple(buckets) != DEFAULT_BUCKETS:
        raise ValueError(f"the real loop tunes every bucket of {DEFAULT_BUCKETS}")
    started = time.perf_counter()
    tuner = AutoTuner.get()
    generator = torch.Generator().manual_seed(0)
    group = get_autotune_process_group()
    before = _winners(tuner)
    hits = fallbacks = 0
    if not sync:
        set_autotune_process_group(None)
    try:
        with cpu_timing() as count, autotune(True):
            for index, (k, n) in enumerate(shapes):
                faults = Faults(
                    tuple(sorted((skew or {}).items())), fail_tactic, oom=index == oom_shape
                )
                runner = HookedStandInRunner(rank_tag, faults)
                hits += _held(tuner, runner, k, n, buckets)
                a = torch.randn(buckets[-1], k, generator=generator)
                b = torch.randn(k, n, generator=generator)
                chosen, tactic = tuner.choose_one(STANDIN_OP, [runner], CONFIG, [a, b])
                if tactic == -1:
                    fallbacks += 1
                del chosen, runner
    finally:
        if not sync:
            set_autotune_process_group(group)
        del group  # keep no reference to the tuning group (see ficache.sync)
    return LoopResult(
        profiled=len(_winners(tuner) - before),
        hits=hits,
        reduces=count.all_reduces,
        fallbacks=fallbacks,
        seconds=time.perf_counter() - started,
    )


@dataclass(frozen=True)
class ServeResult:
    """What one ``real_loop_serve`` call did on this rank."""

    tactics: dict[str, Any]  # file_key -> the tactic choose_one returned (-1: the fallback)
    profiled: int  # keys FlashInfer's loop profiled and cached (new in profiling_cache)
    reduces: int  # all-reduces FlashInfer issued
    fallbacks: int  # choose_one calls that returned the fallback (runners[0], -1)
    seconds: float


def real_loop_serve(
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
) -> ServeResult:
    """Ask FlashInfer's real ``choose_one`` for every ``(M, K, N)`` of ``buckets`` x ``shapes``.

    One call per key, each with an ``M`` of its bucket, all under
    ``autotune(True)`` as an engine's warmup runs them: on a tuner that may
    profile, a key it does not hold is profiled; under ``ficache``'s replay
    mode (``FlashInferTuner.replay``) it is FlashInfer's fallback instead.
    ``tactics`` is what each key got, keyed by the entry's ``file_key``.
    """
    if tuple(buckets) != DEFAULT_BUCKETS:
        raise ValueError(f"the real loop serves every bucket of {DEFAULT_BUCKETS}")
    started = time.perf_counter()
    tuner = AutoTuner.get()
    generator = torch.Generator().manual_seed(0)
    before = set(tuner.profiling_cache)
    tactics: dict[str, Any] = {}
    fallbacks = 0
    with cpu_timing() as count, autotune(True):
        for k, n in shapes:
            runner = HookedStandInRunner()
            b = torch.randn(k, n, generator=generator)
            for m in buckets:
                inputs = [torch.randn(m, k, generator=generator), b]
                chosen, tactic = tuner.choose_one(STANDIN_OP, [runner], CONFIG, inputs)
                key = tuner._get_cache_key(
                    STANDIN_OP,
                    runner,
                    ((m, k), (k, n)),
                    CONFIG,
                    runner.get_cache_key_extras(inputs),
                )
                tactics[key.file_key] = tactic
                fallbacks += tactic == -1
                del chosen
    return ServeResult(
        tactics=tactics,
        profiled=len(set(tuner.profiling_cache) - before),
        reduces=count.all_reduces,
        fallbacks=fallbacks,
        seconds=time.perf_counter() - started,
    )
