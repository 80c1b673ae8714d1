"""Lazy exports for package ``__init__`` modules: attributes load their module on first access."""

from __future__ import annotations

import importlib
from typing import Dict


def lazy_exports(namespace: dict, exports: Dict[str, str]) -> None:
    """Give the package whose globals are ``namespace`` an ``__all__``, ``__getattr__`` and ``__dir__``
    serving ``exports`` (public name -> submodule relative to the package)."""
    package = namespace["__name__"]

    def __getattr__(name: str):
        module = exports.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", package), name)
        namespace[name] = value
        return value

    def __dir__():
        return sorted(set(namespace) | set(exports))

    namespace.update(__all__=sorted(exports), __getattr__=__getattr__, __dir__=__dir__)
