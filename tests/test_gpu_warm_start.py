"""Item 5's proof on real GPUs: FlashInfer's own tuning, 2 ranks (one per GPU), gloo.

Runs ``benchmarks/gpu_proof.py`` (which prints the same figures as JSON) and
asserts on them: a cold start commits all 52 entries with 0 disagreements; a
second start loads them all, profiles nothing and commits nothing; after half
the entries are deleted, a third start tunes exactly that half, synchronized,
and commits it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu


def _two_gpus() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available() and torch.cuda.device_count() >= 2


def _proof() -> Any:
    path = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_proof.py"
    spec = importlib.util.spec_from_file_location("gpu_proof", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not _two_gpus(), reason="needs 2 CUDA GPUs")
def test_warm_start_on_two_gpus_with_real_flashinfer_tuning() -> None:
    figures = _proof().run(2)
    n = figures["entries"]
    assert n == 52

    cold = figures["cold"]
    assert (cold["status"], cold["tuned"], cold["committed"], cold["shared"]) == ("cold", n, n, n)
    assert cold["disagreements"] == 0 and cold["synchronized"] is True and cold["reason"] is None
    assert cold["profiled_by_rank"] == [n, n]

    warm = figures["warm"]
    assert (warm["status"], warm["loaded"], warm["tuned"], warm["committed"]) == ("warm", n, 0, 0)
    assert warm["commit_id"] is None
    assert warm["profiled_by_rank"] == [0, 0]  # FlashInfer profiled nothing

    half = figures["half"]
    assert half["deleted"] == n // 2
    assert (half["status"], half["loaded"], half["tuned"], half["committed"]) == (
        "partial",
        n // 2,
        n // 2,
        n // 2,
    )
    assert half["profiled_by_rank"] == [n // 2, n // 2]
    assert half["profiled_exactly_the_deleted_keys"] is True
    assert half["disagreements"] == 0 and half["synchronized"] is True and half["shared"] == n // 2
    assert figures["final_caches_identical_on_every_rank"] is True
