"""Deterministic mode: whether an op should reduce its weight gradients in a fixed order.

Some backward kernels add per-program partial sums into float32 accumulators with atomics, so the
summation order (and the last bits of the gradient) changes from run to run. An op that takes
``deterministic=None`` follows ``FLAGS_cudnn_deterministic`` (PaddleNLP's switch for reproducible
runs, ``paddle.set_flags({"FLAGS_cudnn_deterministic": True})``); True or False overrides the flag.
Paddle's CPU builds do not register that flag (``get_flags``/``set_flags`` raise for it), so there
the environment variable of the same name, which Paddle reads at start-up on GPU builds, stands in.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

FLAG = "FLAGS_cudnn_deterministic"


@functools.lru_cache(maxsize=None)
def _paddle_has_flag() -> bool:
    """Whether this Paddle build registers FLAG (a property of the build; asking a build without it
    costs an exception per call, and the ops ask per call)."""
    import paddle  # here, so that runtime stays importable without paddle

    try:
        paddle.get_flags([FLAG])
    except ValueError:
        return False
    return True


def deterministic_requested(deterministic: Optional[bool] = None) -> bool:
    """``deterministic`` when given (bool), else Paddle's ``FLAGS_cudnn_deterministic``."""
    if deterministic is not None:
        if not isinstance(deterministic, bool):
            raise TypeError(f"deterministic: expected None, True or False, got {deterministic!r}")
        return deterministic
    if _paddle_has_flag():
        import paddle

        return bool(paddle.get_flags([FLAG])[FLAG])
    return os.environ.get(FLAG, "").strip().lower() in ("1", "true", "yes", "on")
