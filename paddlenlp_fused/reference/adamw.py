"""Host AdamW step for one parameter: the ground truth of the multi-tensor kernel and the fallback
where Triton cannot run.

The same fp32 operations in the same order as ``kernels/triton/adamw.py`` (whose module docstring
states the update), on the same per-tensor scalars ``hyper`` = (beta1, 1 - beta1, beta2, 1 - beta2,
epsilon, 1 - lr * weight_decay, 1 / sqrt(1 - beta2^t), -lr / (1 - beta1^t)) as float32 values: with
round-to-nearest storage the two paths agree bit for bit on the CPU (the kernel in Triton's
interpreter). Stochastic rounding has the kernel's distribution (the neighbour of larger magnitude
with probability equal to x's fractional position between the two) with random bits from numpy's
Philox keyed by ``random_key``, a different stream from the kernel's.

The arithmetic runs in numpy, block by block, on zero-copy views of the tensors (CPU; other places
go through host copies), writing the results in place: each out-of-place Paddle CPU op on a large
tensor costs ~7 ms per million elements (fresh allocations fault their pages in), numpy's ~0.1 ms;
numpy's float32 sqrt and division are correctly rounded, as the kernel's are in the interpreter.
16-bit values travel as their bit patterns (numpy has no bfloat16).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np
import paddle

_SIXTEEN_BIT = ("float16", "bfloat16")
_BF16_NAN = np.uint16(0x7FC0)
_BF16_MAX_MAGNITUDE = 0x7F7F


def _dtype_name(t) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def _host(t: paddle.Tensor, dtype: str) -> np.ndarray:
    """Read-only numpy view of ``t`` of dtype name ``dtype`` (16-bit as uint16 bit patterns); DLPack
    shares a CPU tensor's memory, other places are copied to the host first."""
    if not t.place.is_cpu_place():
        t = t.cpu()
    if not t.is_contiguous():
        t = t.contiguous()
    t = t.detach()  # DLPack refuses tensors that require gradients; detach shares the memory
    if dtype in _SIXTEEN_BIT:  # DLPack carries neither bfloat16 nor uint16
        return np.from_dlpack(t.view("int16")).view(np.uint16)
    return np.from_dlpack(t)


def _to_float32(a: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (a.astype(np.uint32) << 16).view(np.float32)
    if dtype == "float16":
        return a.view(np.float16).astype(np.float32)
    return a.astype(np.float32, copy=False)


def _nearest_bits(x: np.ndarray, dtype: str) -> np.ndarray:
    """Bit patterns of fp32 ``x`` rounded to the 16-bit ``dtype``, to nearest even; bf16 NaN -> 0x7FC0
    (the kernel's ``_nearest``)."""
    if dtype == "bfloat16":
        bits = x.view(np.uint32)
        rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)
        return np.where(np.isnan(x), _BF16_NAN, rounded)
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as the kernel's cast
        return x.astype(np.float16).view(np.uint16)


def _stochastic_bits(x: np.ndarray, dtype: str, r16: np.ndarray) -> np.ndarray:
    """Bit patterns of fp32 ``x`` rounded to the 16-bit ``dtype``: the neighbour of larger magnitude
    ``hi`` when ``u * |hi - lo| < |x - lo|`` (``lo`` the other neighbour, ``u = r16 / 2^16``, ``r16``
    uniform in [0, 2^16)), else ``lo``. Unbiased except where hi is inf: finite values stay finite."""
    if dtype == "bfloat16":
        # lo is x truncated to its 16 high bits, |hi - lo| one bf16 ulp and |x - lo| the 16 low bits
        # in units of 2^-16 of it, all exact: hi iff r16 < low bits, iff adding 0xFFFF - r16 carries
        bits = x.view(np.uint32)
        out = ((bits + (r16 ^ 0xFFFF)) >> 16).astype(np.uint16)
        edge = (bits & 0x7FFFFFFF) >= 0x7F7F0000  # lo the largest finite (u * inf is never < |x - lo|), inf, NaN
        if edge.any():
            out[edge] = np.where(np.isnan(x[edge]), _BF16_NAN, (bits[edge] >> 16).astype(np.uint16))
        return out
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as the kernel's cast
        nearest = x.astype(np.float16)
    nearest32 = nearest.astype(np.float32)
    toward_zero = np.abs(nearest32) > np.abs(x)  # nearest lies beyond x: the other neighbour is inside
    step = np.where(toward_zero, np.int16(-1), np.int16(1))
    neighbour = (nearest.view(np.int16) + step).view(np.float16).astype(np.float32)
    lo = np.where(toward_zero, neighbour, nearest32)
    hi = np.where(toward_zero, nearest32, neighbour)
    u = r16.astype(np.float32) * np.float32(1.0 / 65536.0)
    with np.errstate(invalid="ignore", over="ignore"):  # inf - inf and 0 * inf at the edges compare False
        up = u * np.abs(hi - lo) < np.abs(x - lo)
    return np.where(up, hi, lo).astype(np.float16).view(np.uint16)


def stochastic_round(x: paddle.Tensor, dtype: str, r16: paddle.Tensor) -> paddle.Tensor:
    """fp32 ``x`` to the 16-bit ``dtype``, rounding up to the next representable value (away from
    the nearer-to-zero neighbour ``lo``) when ``u * (hi - lo) < x - lo`` in magnitude, with
    ``u = r16 / 2^16`` and ``r16`` int32 uniform in [0, 2^16). Unbiased: E[out] = x."""
    bits = _stochastic_bits(_host(x, "float32"), dtype, _host(r16, "int32").astype(np.uint32))
    return paddle.to_tensor(bits.view(np.int16), place=x.place).view(dtype)


def _philox(key: Sequence[int]) -> np.random.Philox:
    return np.random.Philox(np.random.SeedSequence([int(k) & (2**64 - 1) for k in key]))


def _random16(rng: np.random.Philox, n: int) -> np.ndarray:
    """The next ``n`` uint16 uniform values of ``rng``: the high halves of its 32-bit outputs (low
    word of each 64-bit draw first), which is what ``Generator.integers(0, 2^16)`` returns for them,
    drawn without its per-value loop. Consecutive calls continue the stream when ``n`` is even."""
    return rng.random_raw((n + 1) // 2).view(np.uint16)[1::2][:n]


def _rounded(value: np.ndarray, dtype: str, rng: Optional[np.random.Philox]) -> np.ndarray:
    """fp32 ``value`` in ``dtype``'s storage (16-bit as bit patterns), stochastically when ``rng``."""
    if dtype not in _SIXTEEN_BIT:
        return value
    if rng is None:
        return _nearest_bits(value, dtype)
    return _stochastic_bits(value, dtype, _random16(rng, value.size))


def _writable(t: paddle.Tensor, dtype: str) -> np.ndarray:
    """Flat numpy view of a contiguous CPU tensor's memory (16-bit: uint16 bit patterns) to write
    the new values into: NumPy marks DLPack imports read-only, so the view is built on data_ptr()."""
    if not t.is_contiguous():
        raise ValueError(f"adamw_step_ref: outputs must be contiguous, got strides {list(t.strides)}")
    ctype = ctypes.c_uint16 if dtype in _SIXTEEN_BIT else ctypes.c_float
    return np.ctypeslib.as_array(ctypes.cast(t.data_ptr(), ctypes.POINTER(ctype)), shape=(int(t.size),))


# Elements per pass: the temporaries stay in cache and in malloc's heap (fresh multi-megabyte arrays
# fault their pages in, which cost more than the arithmetic). Even, so random streams continue.
_BLOCK = 1 << 15


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
    tensors = (param, grad, exp_avg, exp_avg_sq, master)
    if not all(t is None or t.place.is_cpu_place() for t in tensors):  # through host copies
        host = [None if t is None else t.cpu() for t in tensors]
        adamw_step_ref(*host, hyper, stochastic_rounding, random_key)
        for t, h in zip(tensors, host):
            if t is not None and t is not grad:
                paddle.assign(h._copy_to(t.place, True), output=t)
        return
    if param.size == 0:
        return
    beta1, one_minus_beta1, beta2, one_minus_beta2, epsilon, decay, bias2_rsqrt, neg_step = (
        np.float32(h) for h in hyper)
    weight = master if master is not None else param
    g_dtype, w_dtype, m_dtype, v_dtype, p_dtype = (_dtype_name(t) for t in (grad, weight, exp_avg, exp_avg_sq, param))
    ins = [(_host(t, dtype).reshape(-1), dtype)
           for t, dtype in ((grad, g_dtype), (weight, w_dtype), (exp_avg, m_dtype), (exp_avg_sq, v_dtype))]
    # a generator only for the outputs rounded stochastically (seeding one is not free)
    sr_param = master is None and p_dtype in _SIXTEEN_BIT
    rng = [_philox(tuple(random_key) + (i,)) if stochastic_rounding and used else None
           for i, used in enumerate((m_dtype in _SIXTEEN_BIT, v_dtype in _SIXTEEN_BIT, sr_param))]
    m_out, v_out, p_out = _writable(exp_avg, m_dtype), _writable(exp_avg_sq, v_dtype), _writable(param, p_dtype)
    w_out = _writable(master, "float32") if master is not None else None
    for s in range(0, int(param.size), _BLOCK):
        # this block's inputs are read into fresh arrays before its outputs overwrite them
        g, w, m, v = (_to_float32(a[s:s + _BLOCK], dtype) for a, dtype in ins)
        # one rounding per operation, in the kernel's order; in place where that rounds the same
        w = np.multiply(w, decay)
        m = np.multiply(m, beta1)
        m += g * one_minus_beta1
        v = np.multiply(v, beta2)
        v += np.multiply(g, one_minus_beta2) * g
        denom = np.sqrt(v)
        denom *= bias2_rsqrt
        denom += epsilon
        update = np.divide(m, denom, out=denom)
        update *= neg_step
        w += update
        m_out[s:s + _BLOCK] = _rounded(m, m_dtype, rng[0])
        v_out[s:s + _BLOCK] = _rounded(v, v_dtype, rng[1])
        if w_out is not None:
            w_out[s:s + _BLOCK] = w
            p_out[s:s + _BLOCK] = _rounded(w, p_dtype, None)
        else:
            p_out[s:s + _BLOCK] = _rounded(w, p_dtype, rng[2])
