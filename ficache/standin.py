"""A CPU STAND-IN for FlashInfer's profiling: a fake at the GPU boundary.

FlashInfer's ``AutoTuner`` times tactics with CUDA events, so it cannot
profile on a machine without a GPU. The demo and the tests still need real
tuning results in the real ``AutoTuner`` to exercise the startup protocol.
This module produces them and is named as what it is: a stand-in.

What is real and what is not:
- Real: the ``AutoTuner`` singleton, its lookup (``search_cache``: a
  loaded or tuned entry is a hit and is not profiled again), its
  ``profiling_cache`` keyed by real ``ProfilingCacheKey`` objects (so
  ``save_configs`` and ``ficache.tuner`` see exactly what FlashInfer would
  store), the distributed contract (while a process group is set with
  ``set_autotune_process_group``, every per-tactic timing is all-reduced
  over it, float64 SUM divided by the world size, one reduce per tactic,
  exactly as ``AutoTuner._profile_single_kernel`` does), and the timings
  themselves (CPU matmul variants, measured with ``time.perf_counter``).
- Stand-in: the profiling loop of ``AutoTuner.choose_one``, replaced by
  ``standin_tune`` below, which stops at the boundary FlashInfer's would
  cross: it writes the winner into ``profiling_cache`` and nothing else.

Test hooks, named as such: ``rank_tag`` adds a per-rank value to the key's
extras (as FlashInfer's MoE runners add their tp/ep rank), ``sync=False``
ignores the process group (independent tuning), and ``force_tactic`` picks a
given tactic instead of the fastest (to make ranks disagree on purpose). With
``sync=True`` the all-reduces still happen under ``force_tactic``, so the
collective sequence is unchanged.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from flashinfer.autotuner import (
    AutoTuner,
    ProfilingCacheKey,
    TunableRunner,
    get_autotune_process_group,
)

from ficache.tunable_matmul import floor_bucket, m_bucketed_config, matmul_variant

#: The custom-op name of the stand-in's entries (never a FlashInfer op).
STANDIN_OP = "ficache::cpu_standin_matmul"
#: Tactics: 0 ``a @ b``, 1 ``torch.mm``, 2 ``(b.T @ a.T).T``, 3 split-K, 4 split-M.
TACTICS = (0, 1, 2, 3, 4)
#: ``(K, N)`` weight shapes and ``M`` buckets tuned by default (18 entries).
DEFAULT_SHAPES: tuple[tuple[int, int], ...] = ((128, 128), (128, 256), (256, 128))
DEFAULT_BUCKETS: tuple[int, ...] = (1, 2, 4, 8, 16, 32)


def _bucket(m: int) -> int:
    return floor_bucket(m, DEFAULT_BUCKETS)


#: The stand-in op's tuning config: M (dim 0 of input 0) is the dynamic dimension.
CONFIG = m_bucketed_config(DEFAULT_BUCKETS)


class CpuStandInMatmulRunner(TunableRunner):
    """Five CPU variants of one matmul; a ``TunableRunner`` FlashInfer accepts."""

    def __init__(self, rank_tag: str | None = None) -> None:
        self.rank_tag = rank_tag

    def get_valid_tactics(self, inputs: list[torch.Tensor], profile: Any) -> list[int]:
        return list(TACTICS)

    def get_cache_key_extras(self, inputs: list[torch.Tensor]) -> tuple[Any, ...]:
        extras: tuple[Any, ...] = (inputs[0].dtype,)
        return extras + ((self.rank_tag,) if self.rank_tag is not None else ())

    def forward(
        self,
        inputs: list[torch.Tensor],
        tactic: Any = -1,
        do_preparation: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        a, b = inputs
        return matmul_variant(a, b, tactic)


@dataclass(frozen=True)
class StandInResult:
    """What one ``standin_tune`` call did on this rank."""

    profiled: int  # (op, bucket) keys timed and written into profiling_cache
    hits: int  # keys the AutoTuner already held (loaded or tuned): not profiled
    reduces: int  # all-reduces issued over the autotune process group
    seconds: float


def _time_ms(
    runner: CpuStandInMatmulRunner, inputs: list[torch.Tensor], tactic: int, repeat: int
) -> float:
    runner(inputs, tactic=tactic)  # warmup
    samples = []
    for _ in range(repeat):
        start = time.perf_counter()
        runner(inputs, tactic=tactic)
        samples.append((time.perf_counter() - start) * 1e3)
    return statistics.median(samples)


def standin_tune(
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    rank_tag: str | None = None,
    sync: bool = True,
    force_tactic: int | None = None,
    repeat: int = 3,
    seed: int = 0,
) -> StandInResult:
    """Tune the stand-in op for every ``(K, N)`` in ``shapes`` and ``M`` in ``buckets``.

    Each key the ``AutoTuner`` already holds is a hit and is skipped; every
    other key is timed, all-reduced over the autotune process group when one
    is set (and ``sync``), and its fastest tactic stored in ``profiling_cache``.
    """
    started = time.perf_counter()
    tuner = AutoTuner.get()
    runner = CpuStandInMatmulRunner(rank_tag)
    generator = torch.Generator().manual_seed(seed)
    profiled = hits = reduces = 0
    for k, n in shapes:
        b = torch.randn(k, n, generator=generator)
        for m in buckets:
            if m not in DEFAULT_BUCKETS:
                raise ValueError(
                    f"bucket {m} is not one of the stand-in's buckets {DEFAULT_BUCKETS}"
                )
            inputs = [torch.randn(m, k, generator=generator), b]
            hit, _runner_id, _tactic, _profile = tuner.search_cache(
                STANDIN_OP, [runner], ((m, k), (k, n)), CONFIG, inputs=inputs
            )
            if hit:
                hits += 1
                continue
            timings, reduced = _tactic_timings(runner, inputs, repeat, sync=sync)
            reduces += reduced
            best = (
                force_tactic if force_tactic is not None else TACTICS[timings.index(min(timings))]
            )
            _store_winner(tuner, runner, inputs, (m, k, n), best)
            profiled += 1
    return StandInResult(profiled, hits, reduces, time.perf_counter() - started)


def _tactic_timings(
    runner: CpuStandInMatmulRunner, inputs: list[torch.Tensor], repeat: int, *, sync: bool
) -> tuple[list[float], int]:
    """Every tactic's time in ms, each all-reduced over the autotune process group when one
    is set (and ``sync``): the mean over ranks, one reduce per tactic, as FlashInfer's
    ``_profile_single_kernel``. Returns the timings and the reduces issued."""
    import torch.distributed as dist

    timings = []
    reduces = 0
    for tactic in TACTICS:
        ms = _time_ms(runner, inputs, tactic, repeat)
        # Read the group each time and keep no reference to it, as FlashInfer
        # does (a held reference would keep a released group's sockets open).
        if sync and get_autotune_process_group() is not None:
            reduced = torch.tensor([ms], dtype=torch.float64)
            dist.all_reduce(reduced, op=dist.ReduceOp.SUM, group=get_autotune_process_group())
            reduces += 1
            ms = reduced.item() / dist.get_world_size(get_autotune_process_group())
        timings.append(ms)
    return timings, reduces


def _store_winner(
    tuner: AutoTuner,
    runner: CpuStandInMatmulRunner,
    inputs: list[torch.Tensor],
    mkn: tuple[int, int, int],
    best: int,
) -> None:
    """Write tactic ``best`` for the ``(M, K, N)`` key into ``profiling_cache``, keyed as
    FlashInfer keys it (``M`` bucketed): the boundary its profiling loop would cross."""
    m, k, n = mkn
    key = ProfilingCacheKey(
        custom_op=STANDIN_OP,
        runner_class_name=type(runner).__name__,
        runner_hash=hash(runner),
        nearest_profile=((_bucket(m), k), (k, n)),
        extras=runner.get_cache_key_extras(inputs),
    )
    tuner.profiling_cache[key] = (best, None)


def standin_keys(
    shapes: Sequence[tuple[int, int]] = DEFAULT_SHAPES,
    buckets: Sequence[int] = DEFAULT_BUCKETS,
    *,
    rank_tag: str | None = None,
) -> list[str]:
    """The FlashInfer ``file_key`` strings ``standin_tune`` produces."""
    runner = CpuStandInMatmulRunner(rank_tag)
    keys = []
    for k, n in shapes:
        for m in buckets:
            extras = runner.get_cache_key_extras([torch.empty(0, dtype=torch.float32)])
            keys.append(str((STANDIN_OP, type(runner).__name__, ((_bucket(m), k), (k, n)), extras)))
    return keys
