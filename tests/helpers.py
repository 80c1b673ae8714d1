"""Shared helpers of the CPU suite."""

from __future__ import annotations

import numpy as np
import paddle

DTYPES = ("float32", "float16", "bfloat16")


def randn(shape, dtype="float32", scale=1.0, requires_grad=False) -> paddle.Tensor:
    t = paddle.to_tensor(np.random.randn(*shape).astype(np.float32) * scale).astype(dtype)
    t.stop_gradient = not requires_grad
    return t


def to64(t) -> np.ndarray:
    return t.astype("float32").numpy().astype(np.float64) if t.dtype == paddle.bfloat16 else \
        t.numpy().astype(np.float64)


def as_leaf64(t) -> paddle.Tensor:
    """A float64 leaf with the same values, for the reference graph."""
    leaf = paddle.to_tensor(to64(t))
    leaf.stop_gradient = False
    return leaf


# (deterministic argument, FLAGS_cudnn_deterministic environment value or None for unset): the
# calls an op's deterministic option is tested with; the requested mode is True for the 2nd and 4th
DETERMINISTIC_SETTINGS = ((None, None), (True, None), (False, "1"), (None, "1"))


def deterministic_settings(monkeypatch, settings=DETERMINISTIC_SETTINGS):
    """Each (deterministic, env) of ``settings`` with FLAGS_cudnn_deterministic set (or unset) to env:
    the environment variable stands for the flag on Paddle's CPU builds (runtime/determinism.py)."""
    for deterministic, env in settings:
        if env is None:
            monkeypatch.delenv("FLAGS_cudnn_deterministic", raising=False)
        else:
            monkeypatch.setenv("FLAGS_cudnn_deterministic", env)
        yield deterministic, env
