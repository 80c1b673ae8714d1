"""Deterministic mode: whether an op should reduce its weight gradients in a fixed order.

Some backward kernels add per-program partial sums into float32 accumulators with atomics, so the
summation order (and the last bits of the gradient) changes from run to run. An op that takes
``deterministic=None`` follows ``FLAGS_cudnn_deterministic`` (PaddleNLP's switch for reproducible
runs, ``paddle.set_flags({"FLAGS_cudnn_deterministic": True})``); True or False overrides the flag.
Paddle's CPU builds do not register that flag (``get_flags``/``set_flags`` raise for it), so there
the environment variable of the same name, which Paddle reads at start-up on GPU builds, stands in.
"""

from __future__ import annotations

import os
from typing import Optional

FLAG = "FLAGS_cudnn_deterministic"


def deterministic_requested(deterministic: Optional[bool] = None) -> bool:
    """``deterministic`` when given (bool), else Paddle's ``FLAGS_cudnn_deterministic``."""
    if deterministic is not None:
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected None, True or False, got {deterministic!r}")
        return deterministic
    import paddle  # here, so that runtime stays importable without paddle

    try:
        return bool(paddle.get_flags([FLAG])[FLAG])
    except ValueError:  # a build without the flag
        return os.environ.get(FLAG, "").strip().lower() in ("1", "true", "yes", "on")
