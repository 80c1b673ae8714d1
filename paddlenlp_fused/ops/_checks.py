"""Argument checks shared by the ops: clear errors naming the argument, before any kernel runs."""

from __future__ import annotations

import math
import numbers

import paddle

from ..runtime import tensor as T

FLOAT_DTYPES = T.FLOAT_DTYPES


def check_tensor(name: str, t, float_dtypes=FLOAT_DTYPES, min_ndim: int = 1) -> None:
    """``t`` is a Paddle tensor of one of ``float_dtypes`` (names) with at least ``min_ndim`` axes."""
    if not isinstance(t, paddle.Tensor):
        raise TypeError(f"{name}: expected a paddle.Tensor, got {type(t).__name__}")
    if float_dtypes is not None and T.dtype_name(t) not in float_dtypes:
        raise TypeError(f"{name}: expected dtype in {list(float_dtypes)}, got {T.dtype_name(t)}")
    if t.ndim < min_ndim:
        raise ValueError(f"{name}: expected at least {min_ndim} axes, got shape {list(t.shape)}")


def check_eps(name: str, eps) -> float:
    """``eps`` (a norm's variance epsilon) as a float: a real number, finite and >= 0. NaN or inf
    would silently turn every output into NaN or zeros."""
    # (a plain float first: isinstance against numbers.Real is slow, and the ops check per call)
    if type(eps) is not float and (isinstance(eps, bool) or not isinstance(eps, numbers.Real)):
        raise TypeError(f"{name}: expected a float, got {type(eps).__name__}")
    value = float(eps)
    if not (math.isfinite(value) and value >= 0.0):
        raise ValueError(f"{name}: expected a finite float >= 0, got {eps!r}")
    return value


def contiguous(t):
    """``t`` itself when row-major contiguous, else a contiguous copy."""
    return t if t is None or t.is_contiguous() else t.contiguous()


def device_of(t) -> str:
    return T.device_kind(t)
