"""Where a test finds FlashInfer 0.7.2.post1 (vLLM 0.33's), to run what that release saves and loads.

The tox env ``vllm`` holds that release. ``tox -e test`` names that env's
python in ``FICACHE_TEST_FLASHINFER_072_PYTHON`` (tox's
``{[testenv:vllm]env_python}``: wherever tox puts its envs, never a path
guessed inside the checkout). Without tox, point the variable at any python
with ``flashinfer-python==0.7.2.post1`` and ``torch`` installed.

Invariant: CI never skips a 0.7.2 check silently. Where that python is
missing, a test that needs it is skipped (saying how to get it), except
under CI (``CI`` set, as CI's machine sets it and ``tox -e test`` passes
it on), where it fails.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

ENV = "FICACHE_TEST_FLASHINFER_072_PYTHON"


def under_ci() -> bool:
    return os.environ.get("CI", "").strip().lower() not in ("", "0", "false", "no")


def flashinfer_072_python() -> str:
    """The path of a python with FlashInfer 0.7.2.post1; skips, or under CI fails, without one."""
    value = os.environ.get(ENV, "").strip()
    if value and Path(value).is_file():
        return value
    why = (
        f"{ENV}={value} names no python" if value else f"{ENV} is not set"
    ) + "; `tox -e vllm` builds FlashInfer 0.7.2.post1's env, and `tox -e test` then finds it"
    if under_ci():
        pytest.fail(f"CI must run the FlashInfer 0.7.2.post1 checks: {why}", pytrace=False)
    pytest.skip(why)
