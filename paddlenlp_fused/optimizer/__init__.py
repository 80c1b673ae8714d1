"""Optimizers: ``FusedAdamW`` (AdamW with 16-bit moments, one fused launch per dtype group).

Loaded lazily, so ``import paddlenlp_fused.optimizer`` compiles nothing."""

from __future__ import annotations

import importlib

_EXPORTS = {
    "FusedAdamW": "adamw",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'paddlenlp_fused.optimizer' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(__all__))
