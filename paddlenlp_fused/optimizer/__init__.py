"""Optimizers: ``FusedAdamW`` (AdamW with 16-bit moments, one fused launch per dtype group).

Loaded lazily, so ``import paddlenlp_fused.optimizer`` compiles nothing."""

from __future__ import annotations

from .._lazy import lazy_exports

_EXPORTS = {
    "FusedAdamW": "adamw",
}

lazy_exports(globals(), _EXPORTS)
