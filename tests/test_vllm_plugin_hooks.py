"""The vLLM plugin's mechanics that need no vLLM: the switch, the import hook, the fallback.

Runs everywhere (``tests/test_vllm_plugin.py`` covers the real thing under
``tox -e vllm``). The module being patched is a stand-in module written to
``tmp_path`` and named as such: ``TARGET_MODULE`` is pointed at it.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

import ficache.vllm_plugin as plugin

STANDIN_KERNEL_WARMUP = """
calls = []


def flashinfer_autotune(runner, *, skip_attn=False):
    calls.append((runner, skip_attn))
    return "vllm's result"
"""


@pytest.fixture
def standin_target(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A stand-in for vLLM's kernel_warmup (only ``flashinfer_autotune``), importable, not imported."""
    name = f"ficache_standin_kernel_warmup_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(STANDIN_KERNEL_WARMUP)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(plugin, "TARGET_MODULE", name)
    monkeypatch.setattr(plugin, "_finder", None)
    monkeypatch.setattr(plugin, "_warned", set())
    monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))
    monkeypatch.delenv("FICACHE_VLLM", raising=False)
    yield name
    sys.modules.pop(name, None)


@pytest.mark.parametrize(
    ("value", "expected"),
    [(None, True), ("1", True), ("yes", True), ("0", False), ("false", False), (" OFF ", False)],
)
def test_switch(monkeypatch: pytest.MonkeyPatch, value: str | None, expected: bool) -> None:
    if value is None:
        monkeypatch.delenv("FICACHE_VLLM", raising=False)
    else:
        monkeypatch.setenv("FICACHE_VLLM", value)
    assert plugin.enabled() is expected


def test_import_hook_patches_the_module_when_it_is_imported(standin_target: str) -> None:
    plugin.register()
    plugin.register()  # idempotent: one finder
    assert sum(isinstance(f, plugin._PatchOnImport) for f in sys.meta_path) == 1
    assert standin_target not in sys.modules
    module = importlib.import_module(standin_target)
    wrapper = module.flashinfer_autotune
    original = wrapper.__ficache_original__
    assert original.__module__ == standin_target and original.__name__ == "flashinfer_autotune"
    assert module.__file__ is not None and module.__file__.endswith(f"{standin_target}.py")


def test_module_imported_before_register_is_patched_in_place_once(standin_target: str) -> None:
    module = importlib.import_module(standin_target)
    original = module.flashinfer_autotune
    plugin.register()
    plugin.register()
    assert module.flashinfer_autotune.__ficache_original__ is original  # not wrapped twice
    assert not any(isinstance(f, plugin._PatchOnImport) for f in sys.meta_path)


def test_switched_off_register_installs_nothing(
    standin_target: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("FICACHE_VLLM", "0")
    before = list(sys.meta_path)
    plugin.register()
    assert sys.meta_path == before
    module = importlib.import_module(standin_target)
    assert not hasattr(module.flashinfer_autotune, "__ficache_original__")


def test_register_never_raises(
    standin_target: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    class Broken(list[Any]):
        def insert(self, index: Any, item: Any) -> None:
            raise RuntimeError("meta_path is read-only here")

    monkeypatch.setattr(sys, "meta_path", Broken(sys.meta_path))
    with caplog.at_level(logging.WARNING, logger="ficache.vllm"):
        plugin.register()
    assert [r.getMessage() for r in caplog.records] == [
        "ficache: vLLM plugin not installed (RuntimeError: meta_path is read-only here)"
    ]


def test_unsupported_shape_runs_the_original_unchanged_with_one_warning(
    standin_target: str, caplog: pytest.LogCaptureFixture
) -> None:
    module = importlib.import_module(standin_target)
    plugin.register()
    runner = object()
    with caplog.at_level(logging.WARNING, logger="ficache.vllm"):
        assert module.flashinfer_autotune(runner, skip_attn=True) == "vllm's result"
        assert module.flashinfer_autotune(runner) == "vllm's result"
    assert module.calls == [(runner, True), (runner, False)]
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1, messages
    assert "lacks resolve_rank_flashinfer_autotune_file, use_flashinfer_autotune_v2" in messages[0]
    assert plugin.last_report() is None


def test_switched_off_at_call_time_calls_the_original(
    standin_target: str, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    module = importlib.import_module(standin_target)
    plugin.register()
    monkeypatch.setenv("FICACHE_VLLM", "0")
    with caplog.at_level(logging.DEBUG, logger="ficache"):
        assert module.flashinfer_autotune("runner") == "vllm's result"
    assert module.calls == [("runner", False)]
    assert caplog.records == []


@pytest.mark.parametrize(
    ("config", "layout"),
    [
        ({}, "tp1-pp1-dp1-ep1"),
        ({"tensor_parallel_size": 2}, "tp2-pp1-dp1-ep1"),
        ({"tensor_parallel_size": 4, "pipeline_parallel_size": 2}, "tp4-pp2-dp1-ep1"),
        (
            {"tensor_parallel_size": 2, "data_parallel_size": 4, "enable_expert_parallel": True},
            "tp2-pp1-dp4-ep8",
        ),
    ],
)
def test_layout_of_a_parallel_config(config: dict[str, Any], layout: str) -> None:
    assert plugin.layout_of(SimpleNamespace(**config)) == layout
