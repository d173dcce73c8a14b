"""A bundled tunable op for GPUs: one matmul, five cuBLAS-backed tactics.

It needs no JIT and runs on any NVIDIA GPU, and its tactics time closely, so
ranks that tune independently disagree often, which is what a proof of
synchronized tuning needs (measured on 2x H200: 15-16 of 52 entries differed
between the ranks when tuned independently, 0 of 52 when synchronized).

Tactics of ``MatmulVariantsRunner``: 0 ``a @ b`` (also the fallback, -1),
1 ``torch.mm``, 2 ``(b.T @ a.T).T``, 3 split-K in two halves, 4 split-M in
two halves. ``M`` (rows of ``a``) is the dynamic dimension, tuned over the
power-of-two buckets 1..4096; ``warmup`` tunes every bucket of every weight
shape through the real ``AutoTuner.choose_one`` under ``autotune(True)``:
13 entries per ``(K, N)``, 52 with the default four shapes.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from flashinfer.autotuner import AutoTuner, DynamicTensorSpec, TunableRunner, TuningConfig, autotune

OP = "ficache::tunable_matmul"
TACTICS = (0, 1, 2, 3, 4)
BUCKETS: tuple[int, ...] = tuple(1 << i for i in range(13))  # 1 .. 4096
#: ``(K, N)`` weight shapes tuned by default.
DEFAULT_WEIGHTS: tuple[tuple[int, int], ...] = (
    (4096, 4096),
    (4096, 14336),
    (14336, 4096),
    (4096, 1024),
)


def floor_bucket(m: int, buckets: Sequence[int]) -> int:
    """The largest of ascending ``buckets`` not above ``m`` (FlashInfer's floor semantics)."""
    best = buckets[0]
    for b in buckets:
        if b <= m:
            best = b
    return best


def m_bucketed_config(buckets: tuple[int, ...]) -> TuningConfig:
    """A tuning config whose dynamic dimension is M (dim 0 of input 0), tuned
    over ``buckets`` and mapped to them with floor semantics."""
    return TuningConfig(
        dynamic_tensor_specs=(
            DynamicTensorSpec(
                input_idx=(0,),
                dim_idx=(0,),
                gen_tuning_buckets=lambda _m: buckets,
                map_to_tuning_buckets=lambda m: floor_bucket(m, buckets),
            ),
        )
    )


def bucket(m: int) -> int:
    return floor_bucket(m, BUCKETS)


CONFIG = m_bucketed_config(BUCKETS)


def matmul_variant(a: torch.Tensor, b: torch.Tensor, tactic: Any) -> torch.Tensor:
    """``a @ b`` computed the way ``tactic`` says (-1 and 0: plain ``@``).

    1: ``torch.mm``; 2: ``(b.T @ a.T).T``; 3: split-K in two halves;
    4: split-M in two halves. Same result, slightly different timings.
    """
    if tactic == 1:
        return torch.mm(a, b)
    if tactic == 2:
        return (b.T @ a.T).T
    if tactic == 3 and a.shape[1] >= 2:
        k = a.shape[1] // 2
        return a[:, :k] @ b[:k] + a[:, k:] @ b[k:]
    if tactic == 4 and a.shape[0] >= 2:
        m = a.shape[0] // 2
        return torch.cat([a[:m] @ b, a[m:] @ b])
    return a @ b


class MatmulVariantsRunner(TunableRunner):
    """``a @ b`` five ways; a ``TunableRunner`` for FlashInfer's ``AutoTuner``."""

    def get_valid_tactics(self, inputs: list[torch.Tensor], profile: Any) -> list[int]:
        return list(TACTICS)

    def get_cache_key_extras(self, inputs: list[torch.Tensor]) -> tuple[Any, ...]:
        return (inputs[0].dtype,)

    def forward(
        self,
        inputs: list[torch.Tensor],
        tactic: Any = -1,
        do_preparation: bool = False,
        **kwargs: Any,
    ) -> torch.Tensor:
        a, b = inputs
        return matmul_variant(a, b, tactic)


RUNNER = MatmulVariantsRunner()


def tunable_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``a @ b`` with the tactic FlashInfer's ``AutoTuner`` chose (or tunes now)."""
    runner, tactic = AutoTuner.get().choose_one(OP, [RUNNER], CONFIG, [a, b])
    return runner([a, b], tactic=tactic)


def warmup(
    weights: Sequence[tuple[int, int]] = DEFAULT_WEIGHTS,
    *,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.bfloat16,
) -> int:
    """Tune (or look up) every bucket of every ``(K, N)``; return the number of entries."""
    device = (
        torch.device(device)
        if device is not None
        else torch.device("cuda", torch.cuda.current_device())
    )
    with torch.inference_mode(), autotune(True):
        for k, n in weights:
            a = torch.randn(BUCKETS[-1], k, device=device, dtype=dtype)
            b = torch.randn(k, n, device=device, dtype=dtype)
            tunable_matmul(a, b)
    torch.cuda.synchronize(device)
    return len(weights) * len(BUCKETS)
