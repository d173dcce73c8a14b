"""A STAND-IN for vLLM PR #55671's ``kernel_warmup`` ("Migrate autotune warmup to
flashinfer.autotune_v2 managed cache"), for ``tests/vllm_ranks.py``.

The PR is open and not in vLLM 0.33, and the mirror here may not hold it, so
``flashinfer_autotune`` below is written from its description (issue 19): the
whole warmup runs under ``autotune_v2(mode="tune", cache_root=..., skip_ops=...)``
on every rank, ``set_autotune_process_group`` is kept, and tuning is finalized
with barrier, ``autotune_v2_reload()``, barrier. The module has no
``resolve_rank_flashinfer_autotune_file`` nor ``use_flashinfer_autotune_v2``
(the PR deletes ``flashinfer_autotune_cache.py``). Everything it calls is vLLM
0.33's own: its process groups, ``envs.VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR``,
its skip-ops helper and its dummy runs.
"""

from __future__ import annotations

import types
from pathlib import Path
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
    override = envs.VLLM_FLASHINFER_AUTOTUNE_CACHE_DIR
    cache_root = Path(override).expanduser() if override else None
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
