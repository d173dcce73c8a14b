"""ficache: a versioned registry of FlashInfer autotuning results.

``import ficache`` is light: torch and FlashInfer load only when the
startup protocol (``ficache.warm_start``) or a fingerprint is first used.
"""

from __future__ import annotations

from typing import Any

__version__ = "0.10.0"

_LAZY = {
    "Registry": ("ficache.registry", "Registry"),
    "Fingerprint": ("ficache.fingerprint", "Fingerprint"),
    "FicacheError": ("ficache.errors", "FicacheError"),
    "warm_start": ("ficache.sync", "warm_start"),
    "WarmStartReport": ("ficache.sync", "WarmStartReport"),
}

__all__ = ["__version__", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        module, attr = _LAZY[name]
        return getattr(importlib.import_module(module), attr)
    raise AttributeError(f"module 'ficache' has no attribute {name!r}")
