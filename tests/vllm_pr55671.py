"""A STAND-IN for vLLM PR #55671's ``kernel_warmup`` ("Migrate autotune warmup to
flashinfer.autotune_v2 managed cache"), for ``tests/vllm_ranks.py``.

The PR is open and not in vLLM 0.33, and no stored repository holds its branch,
so ``flashinfer_autotune`` below follows the two sources found (searched
2026-12-04): the PR's description (https://github.com/vllm-project/vllm/pull/55671,
2026-09-07, rebased 2026-09-11) and the draft diff of the same migration posted in
FlashInfer PR #3861's thread (turn 13), also kept in flashinfer-ai/flashinfer as
``framework_patches/vllm_autotune_v2.patch``. The call sequence, every rank:

1. ``set_autotune_process_group`` for the tuning group (the description keeps it;
   the draft diff predates that and sets none), cleared in ``finally``;
2. the dummy runs under ``autotune_v2(mode="tune", cache_root=..., skip_ops=...)``,
   ``cache_root`` being ``VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR`` as given, or None
   (FlashInfer's default root);
3. with more than one rank: world barrier, ``autotune_v2_reload()``, world barrier
   (outside the ``finally``: a failed warmup raises without them); with one rank,
   nothing after the block.

The module has no ``resolve_rank_flashinfer_autotune_file`` nor
``use_flashinfer_autotune_v2`` (the PR deletes ``flashinfer_autotune_cache.py``).
What still differs, and why:

- The PR gates the new path on ``vllm.utils.flashinfer.has_flashinfer_autotune_v2()``;
  what it runs when that is false is in neither source, so the stand-in has no
  gate. FlashInfer 0.7.2.post1 (the ``vllm`` tox env) has ``autotune_v2``, where
  the gated path is the one taken.
- The draft diff also passes ``measurement_policy=MeasurementPolicy(
  execution_mode="auto")``; the description's call names only ``mode``,
  ``cache_root`` and ``skip_ops``, so the stand-in passes none. Tried with the
  draft's policy, the plugin test passes unchanged.
- The process group is vLLM 0.33's tuning group (the TP group when PP > 1, else
  the world); neither source names one. The finalize uses the world group, as the
  draft diff does.
- The dummy runs are vLLM 0.33's own helper (which nests ``autotune(
  tuning_buckets=...)``, as the PR's 2026-09-11 rebase notes), not the draft's
  single ``_dummy_run``; the skip-ops helper and process groups are vLLM 0.33's.
"""

from __future__ import annotations

import types
from typing import Any

MODULE_NAME = "vllm_pr55671_kernel_warmup"


def flashinfer_autotune(runner: Any, *, skip_attn: bool = False) -> None:
    """Autotune FlashInfer operations into FlashInfer's managed store (PR #55671's shape)."""
    import torch
    import vllm.envs as envs
    from flashinfer import autotune_v2, autotune_v2_reload
    from flashinfer.autotuner import set_autotune_process_group
    from vllm.distributed.parallel_state import get_pp_group, get_tp_group, get_world_group
    from vllm.model_executor.warmup import kernel_warmup as vllm_033

    world = get_world_group()
    tune_group = get_tp_group() if get_pp_group().world_size > 1 else world
    cache_root = envs.VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR or None
    skip_ops = vllm_033._flashinfer_autotune_skip_ops(runner)
    group = tune_group.cpu_group if tune_group.world_size > 1 else None
    set_autotune_process_group(group)
    try:
        with (
            torch.inference_mode(),
            autotune_v2(mode="tune", cache_root=cache_root, skip_ops=skip_ops),
        ):
            vllm_033._run_flashinfer_autotune_dummy_runs(runner, skip_attn=skip_attn)
    finally:
        set_autotune_process_group(None)
    if world.world_size > 1:
        world.barrier()
        autotune_v2_reload()
        world.barrier()


def kernel_warmup_module() -> types.ModuleType:
    """A fresh module holding this ``flashinfer_autotune`` (the plugin patches it in place)."""
    module = types.ModuleType(MODULE_NAME)
    module.flashinfer_autotune = flashinfer_autotune  # type: ignore[attr-defined]
    return module
