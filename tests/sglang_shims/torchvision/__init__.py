"""A STAND-IN for torchvision, on ``PYTHONPATH`` in the sglang tox env only.

torchvision's wheels on the package index are built against CUDA torch; on
the CPU wheel of torch its import fails (``operator torchvision::nms does
not exist``). SGLang 0.5.23 imports it at module level in its multimodal
image helpers, which ``sglang.srt.configs`` imports, which the runner
package imports before ``flashinfer_autotune`` (``runner/__init__`` ->
``base_cuda_graph_runner`` -> ``dllm.config`` -> ``configs``). Those helpers
preprocess images; nothing the plugin tests run calls them. So this package
only lets those imports complete: every ``torchvision.X`` module and every
name in it is an inert placeholder, and calling or instantiating one raises
``RuntimeError`` naming this file, so a test that did reach torchvision
would fail loudly instead of running something else.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from types import ModuleType
from typing import Any

__version__ = "0.0.0+ficache.standin"


class _Placeholder:
    def __init__(self, name: str) -> None:
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise RuntimeError(f"{self._name}: torchvision is a stand-in here ({__file__})")

    def __mro_entries__(self, bases: tuple[Any, ...]) -> tuple[type, ...]:
        return (object,)


class _Module(ModuleType):
    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Placeholder(f"{self.__name__}.{attr}")


class _Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        if fullname.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        module = _Module(spec.name)
        module.__path__ = []
        return module

    def exec_module(self, module: ModuleType) -> None:
        return None


sys.meta_path.insert(0, _Finder())
