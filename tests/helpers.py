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
