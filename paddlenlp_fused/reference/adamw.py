"""Pure-Paddle AdamW step for one parameter: the ground truth of the multi-tensor kernel and the
fallback where Triton cannot run.

The same fp32 operations in the same order as ``kernels/triton/adamw.py`` (whose module docstring
states the update), on the same per-tensor scalars ``hyper`` = (beta1, 1 - beta1, beta2, 1 - beta2,
epsilon, 1 - lr * weight_decay, 1 / sqrt(1 - beta2^t), -lr / (1 - beta1^t)) as float32 values: with
round-to-nearest storage the two paths agree bit for bit on the CPU (the kernel in Triton's
interpreter). Stochastic rounding has the kernel's distribution (the neighbour of larger magnitude
with probability equal to x's fractional position between the two) with random bits from numpy's
Philox keyed by ``random_key``, a different stream from the kernel's.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import paddle

_SIXTEEN_BIT = ("float16", "bfloat16")


def _dtype_name(t) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def stochastic_round(x: paddle.Tensor, dtype: str, r16: paddle.Tensor) -> paddle.Tensor:
    """fp32 ``x`` to the 16-bit ``dtype``, rounding up to the next representable value (away from
    the nearer-to-zero neighbour ``lo``) when ``u * (hi - lo) < x - lo`` in magnitude, with
    ``u = r16 / 2^16`` and ``r16`` int32 uniform in [0, 2^16). Unbiased: E[out] = x."""
    nearest = x.astype(dtype)
    nearest32 = nearest.astype("float32")
    toward_zero = nearest32.abs() > x.abs()
    step = 1 - 2 * toward_zero.astype("int32")
    bits = nearest.view("int16").astype("int32")
    neighbour = (bits + step).astype("int16").view(dtype).astype("float32")
    lo = paddle.where(toward_zero, neighbour, nearest32)
    hi = paddle.where(toward_zero, nearest32, neighbour)
    u = r16.astype("float32") * (1.0 / 65536.0)
    return paddle.where(u * (hi - lo).abs() < (x - lo).abs(), hi, lo).astype(dtype)


def _random16(shape, key: Sequence[int], place) -> paddle.Tensor:
    rng = np.random.Generator(np.random.Philox(np.random.SeedSequence([int(k) & (2**64 - 1) for k in key])))
    return paddle.to_tensor(rng.integers(0, 1 << 16, size=shape, dtype=np.int32), place=place)


def _store(dst: paddle.Tensor, value: paddle.Tensor, r16_key=None) -> None:
    """Write fp32 ``value`` into ``dst`` in place, rounding to dst's dtype (stochastically when a
    random key is given and dst is 16-bit)."""
    dtype = _dtype_name(dst)
    if r16_key is not None and dtype in _SIXTEEN_BIT:
        value = stochastic_round(value, dtype, _random16(value.shape, r16_key, value.place))
    else:
        value = value.astype(dtype)
    paddle.assign(value, output=dst)


@paddle.no_grad()
def adamw_step_ref(param: paddle.Tensor, grad: paddle.Tensor, exp_avg: paddle.Tensor,
                   exp_avg_sq: paddle.Tensor, master: Optional[paddle.Tensor], hyper: Sequence[float],
                   stochastic_rounding: bool = False, random_key: Sequence[int] = (0, 0)) -> None:
    """One AdamW step of one parameter, in place: param, exp_avg, exp_avg_sq (and master) updated.

    ``hyper``: the 8 float32 scalars listed in the module docstring. ``master``: fp32 weights of a
    16-bit param, or None (the param itself is updated through fp32). ``stochastic_rounding``:
    16-bit moments (and a 16-bit param without master) round stochastically with random bits keyed
    by ``random_key`` + (output index,).
    """
    beta1, one_minus_beta1, beta2, one_minus_beta2, epsilon, decay, bias2_rsqrt, neg_step = (
        float(np.float32(h)) for h in hyper)
    g = grad.astype("float32")
    w = (master if master is not None else param).astype("float32") * decay
    m = exp_avg.astype("float32") * beta1 + g * one_minus_beta1
    v = exp_avg_sq.astype("float32") * beta2 + g * one_minus_beta2 * g
    # Paddle's CPU float32 sqrt is not correctly rounded; through float64 it is (as the kernel's sqrt_rn)
    denom = paddle.sqrt(v.astype("float64")).astype("float32") * bias2_rsqrt + epsilon
    w = w + m / denom * neg_step

    key = (lambda i: tuple(random_key) + (i,)) if stochastic_rounding else (lambda i: None)
    _store(exp_avg, m, key(0))
    _store(exp_avg_sq, v, key(1))
    if master is not None:
        paddle.assign(w, output=master)
        _store(param, w)
    else:
        _store(param, w, key(2))
