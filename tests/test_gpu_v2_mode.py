"""GPU proof of a v2-mode warm start through FlashInfer's real ``autotune_v2``, with protocol
records.

Runs ``benchmarks/gpu_v2_mode.py`` (which prints the same figures as JSON) on one GPU and
asserts on them: a cold start commits every entry FlashInfer profiled into the store
ficache served, and the 3 protocol records the stand-in protocol published there; a warm
start in a new process profiles nothing, finds every protocol record, publishes none,
commits nothing, and gets every tactic the cold start tuned; nothing lands under the
node-local root the block named.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu

BENCHMARKS = Path(__file__).resolve().parent.parent / "benchmarks"


def _gpu() -> bool:
    try:
        import torch
    except ImportError:  # pragma: no cover
        return False
    return torch.cuda.is_available()


def _proof() -> Any:
    sys.path.insert(0, str(BENCHMARKS))  # gpu_v2_mode imports gpu_v2_proof beside it
    spec = importlib.util.spec_from_file_location("gpu_v2_mode", BENCHMARKS / "gpu_v2_mode.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(not _gpu(), reason="needs a CUDA GPU")
def test_a_v2_mode_warm_start_profiles_nothing_and_serves_protocol_records() -> None:
    figures = _proof().run()
    cold, warm = figures["cold"], figures["warm"]

    assert figures["entries"] > 0
    assert cold["profiled"] == figures["entries"]
    assert figures["cold_committed_every_profiled_entry"] is True
    assert figures["warm_profiled_0"] is True
    assert figures["warm_tactics_equal_cold"] is True
    assert figures["files_published_under_the_node_local_root"] == []
    assert (warm["report"]["status"], warm["report"]["committed"]) == ("warm", 0)
    if cold["protocol"] is not None:  # FlashInfer 0.7.4+: protocol records
        assert cold["protocol"] == {"hits": 0, "published": 3}
        assert cold["report"]["protocol_committed"] == 3
        assert warm["protocol"] == {"hits": 3, "published": 0}
        assert (warm["report"]["protocol_loaded"], warm["report"]["protocol_tuned"]) == (3, 0)
