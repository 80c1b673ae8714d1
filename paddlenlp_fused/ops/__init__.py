"""Functional ops: argument checks, backend dispatch and autograd over the kernels.

Loaded lazily, one module per op family, so importing one op does not compile or import the rest.
The names served here are the ``ops.*`` entries of the package's one export map.
"""

from __future__ import annotations

from .. import _EXPORTS
from .._lazy import lazy_exports, subpackage_exports

lazy_exports(globals(), subpackage_exports(_EXPORTS, "ops", __path__))
