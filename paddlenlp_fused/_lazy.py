"""Lazy exports for package ``__init__`` modules: attributes load their module on first access."""

from __future__ import annotations

import importlib
import pkgutil
from typing import Dict, Iterable


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


def subpackage_exports(exports: Dict[str, str], subpackage: str, path: Iterable[str]) -> Dict[str, str]:
    """The entries of ``exports`` that live in ``subpackage``, relative to it.

    A name that is also a submodule of ``subpackage`` (``gated_activation``) is left out: once any
    code imports that submodule, Python binds the module to the name, so the function could not be
    served reliably; it stays available from the top-level package."""
    prefix = subpackage + "."
    submodules = {info.name for info in pkgutil.iter_modules(path)}
    return {name: module[len(prefix):] for name, module in exports.items()
            if module.startswith(prefix) and name not in submodules}
