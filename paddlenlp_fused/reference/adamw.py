"""Host AdamW step of a group of parameters (or of one): the ground truth of the multi-tensor kernel
and the fallback where Triton cannot run.

The same fp32 operations in the same order as ``kernels/triton/adamw.py`` (whose module docstring
states the update), on the same per-tensor scalars ``hyper`` = (beta1, 1 - beta1, beta2, 1 - beta2,
epsilon, 1 - lr * weight_decay, 1 / sqrt(1 - beta2^t), -lr / (1 - beta1^t)) as float32 values: with
round-to-nearest storage the two paths agree bit for bit on the CPU (the kernel in Triton's
interpreter). Stochastic rounding has the kernel's distribution (the neighbour of larger magnitude
with probability equal to x's fractional position between the two) with random bits from numpy's
SFC64 seeded by ``random_key``, a different stream from the kernel's Philox (and cheaper to draw in
numpy).

The arithmetic runs in numpy, block by block, on zero-copy views of the tensors (CPU; other places
go through host copies), writing the results in place: each out-of-place Paddle CPU op on a large
tensor costs ~7 ms per million elements (fresh allocations fault their pages in), numpy's ~0.1 ms;
numpy's float32 sqrt and division are correctly rounded, as the kernel's are in the interpreter.
16-bit values travel as their bit patterns (numpy has no bfloat16). The blocks run over the group's
elements in order, across tensor boundaries: the host cost of a model of many small tensors is
per block, not per tensor (as the kernel's launch is per group).
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np
import paddle

_SIXTEEN_BIT = ("float16", "bfloat16")
_BF16_NAN = np.uint16(0x7FC0)
_HOST_DTYPES = {"float32": np.dtype(np.float32), "int32": np.dtype(np.int32), "float16": np.dtype(np.uint16),
                "bfloat16": np.dtype(np.uint16)}
_LIST_NAMES = ("params", "grads", "exp_avgs", "exp_avg_sqs", "masters")


def _dtype_name(t) -> str:
    return str(t.dtype).rsplit(".", 1)[-1]


def _numel(t: paddle.Tensor) -> int:
    n = 1
    for s in t.shape:
        n *= s
    return n


def _flat(t: paddle.Tensor, dtype: str) -> np.ndarray:
    """Flat writable numpy view of contiguous CPU tensor ``t``'s memory of dtype name ``dtype``
    (16-bit as uint16 bit patterns). Built on data_ptr() (NumPy marks DLPack imports read-only, and
    this is cheaper): the view does not keep ``t`` alive, so the caller holds ``t`` while using it."""
    n = _numel(t)
    np_dtype = _HOST_DTYPES[dtype]
    if n == 0:
        return np.empty(0, np_dtype)
    return np.frombuffer((ctypes.c_char * (n * np_dtype.itemsize)).from_address(t.data_ptr()), np_dtype)


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
    x_host, r16_host = (t.cpu().contiguous() for t in (x, r16))
    bits = _stochastic_bits(_flat(x_host, "float32"), dtype, _flat(r16_host, "int32").astype(np.uint32))
    return paddle.to_tensor(bits.view(np.int16).reshape(x.shape), place=x.place).view(dtype)


def _bit_generator(key: Sequence[int]) -> np.random.SFC64:
    return np.random.SFC64(np.random.SeedSequence([int(k) & (2**64 - 1) for k in key]))


def _random16(rng: np.random.SFC64, n: int) -> np.ndarray:
    """The next ``n`` uint16 uniform values of ``rng``: each 64-bit output cut into four, lowest
    first. Consecutive calls continue the stream when ``n`` is a multiple of 4."""
    return rng.random_raw((n + 3) // 4).astype("<u8", copy=False).view("<u2")[:n]


def _rounded(value: np.ndarray, dtype: str, rng: Optional[np.random.SFC64]) -> np.ndarray:
    """fp32 ``value`` in ``dtype``'s storage (16-bit as bit patterns), stochastically when ``rng``."""
    if dtype not in _SIXTEEN_BIT:
        return value
    if rng is None:
        return _nearest_bits(value, dtype)
    return _stochastic_bits(value, dtype, _random16(rng, value.size))


# Elements per pass: the temporaries stay in cache and in malloc's heap (fresh multi-megabyte arrays
# fault their pages in, which cost more than the arithmetic). A multiple of 4, so random streams
# continue from block to block.
_BLOCK = 1 << 15


def _block_pieces(sizes: Sequence[int]):
    """The group's elements in order cut into blocks of _BLOCK: for each block, its pieces
    (tensor index, start, stop) within the tensors it covers."""
    pieces, room = [], _BLOCK
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            stop = min(size, start + room)
            pieces.append((i, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                yield pieces
                pieces, room = [], _BLOCK
    if pieces:
        yield pieces


def _gather(views: Sequence[np.ndarray], pieces) -> np.ndarray:
    """A block's values of one kind: a view where the block lies in one tensor, else a copy."""
    if len(pieces) == 1:
        i, start, stop = pieces[0]
        return views[i][start:stop]
    return np.concatenate([views[i][start:stop] for i, start, stop in pieces])


def _scatter(values: np.ndarray, views: Sequence[np.ndarray], pieces) -> None:
    at = 0
    for i, start, stop in pieces:
        views[i][start:stop] = values[at:at + stop - start]
        at += stop - start


def _block_hyper(rows: np.ndarray, pieces) -> list:
    """The 8 scalars of the block's elements: a float32 scalar where its tensors share the value, else
    one per element (the arithmetic is the same elementwise, so both round alike)."""
    members = rows[[i for i, _, _ in pieces]]
    same = (members == members[0]).all(axis=0)
    counts = [stop - start for _, start, stop in pieces]
    return [members[0, k] if same[k] else np.repeat(members[:, k], counts) for k in range(members.shape[1])]


def _dtype_of(name: str, tensors: Sequence[paddle.Tensor]) -> str:
    dtype = tensors[0].dtype  # compared as objects: naming each tensor's dtype costs more
    if any(t.dtype != dtype for t in tensors):
        raise ValueError(f"adamw_multi_tensor_ref: {name} must share one dtype, got "
                         f"{sorted({_dtype_name(t) for t in tensors})}")
    return _dtype_name(tensors[0])


@paddle.no_grad()
def adamw_multi_tensor_ref(params: Sequence[paddle.Tensor], grads: Sequence[paddle.Tensor],
                           exp_avgs: Sequence[paddle.Tensor], exp_avg_sqs: Sequence[paddle.Tensor],
                           masters: Optional[Sequence[paddle.Tensor]], hyper: np.ndarray,
                           stochastic_rounding: bool = False, random_key: Sequence[int] = (0, 0)) -> None:
    """One AdamW step of a group of parameters, in place: params, exp_avgs, exp_avg_sqs (and masters)
    updated. The reference of ``adamw_multi_tensor``, with the same lists (one dtype per list, the
    params, exp_avgs, exp_avg_sqs and masters contiguous).

    ``hyper``: float32 [n, 8], row i the scalars of tensor i (module docstring). ``masters``: fp32
    weights of 16-bit params, or None (the params themselves are updated through fp32).
    ``stochastic_rounding``: 16-bit moments (and 16-bit params without master) round stochastically,
    each output with SFC64 seeded by ``random_key`` + (output index,) drawn over the group's elements
    in order (for one tensor, its elements). The group runs as one flat sequence of blocks, so a group
    of small tensors costs a few numpy calls per block rather than per tensor.
    """
    n = len(params)
    lists = (params, grads, exp_avgs, exp_avg_sqs) + ((masters,) if masters is not None else ())
    if any(len(ts) != n for ts in lists):
        raise ValueError(f"adamw_multi_tensor_ref: expected {n} tensors in every list, got {[len(ts) for ts in lists]}")
    hyper = np.asarray(hyper, dtype=np.float32)
    if hyper.shape != (n, 8):
        raise ValueError(f"adamw_multi_tensor_ref: hyper: expected shape [{n}, 8], got {list(hyper.shape)}")
    if n == 0:
        return
    all_tensors = [t for ts in lists for t in ts]
    if not all(t.place.is_cpu_place() for t in all_tensors):  # through host copies
        host = [[t.cpu() for t in ts] for ts in lists]
        adamw_multi_tensor_ref(*host[:4], host[4] if masters is not None else None, hyper, stochastic_rounding,
                               random_key)
        for k, (ts, hs) in enumerate(zip(lists, host)):
            if k != 1:  # every list but the grads was written
                for t, h in zip(ts, hs):
                    paddle.assign(h._copy_to(t.place, True), output=t)
        return
    sizes = [_numel(p) for p in params]
    for k, ts in enumerate(lists[1:]):
        if any(_numel(t) != size for t, size in zip(ts, sizes)):
            raise ValueError(f"adamw_multi_tensor_ref: {_LIST_NAMES[k + 1]} must have the params' numbers of elements")
    for k, ts in enumerate(lists):
        if k != 1 and not all(t.is_contiguous() for t in ts):
            raise ValueError(f"adamw_multi_tensor_ref: {_LIST_NAMES[k]} must be contiguous")
    # held for the whole call: the numpy views below do not keep their tensors alive
    grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
    p_dtype, g_dtype, m_dtype, v_dtype = (_dtype_of(name, ts) for name, ts in zip(_LIST_NAMES, lists[:4]))
    weights = masters if masters is not None else params
    w_dtype = _dtype_of("masters", masters) if masters is not None else p_dtype
    g_views, w_views, m_views, v_views, p_views = (
        [_flat(t, dtype) for t in ts] for ts, dtype in ((grads, g_dtype), (weights, w_dtype), (exp_avgs, m_dtype),
                                                      (exp_avg_sqs, v_dtype), (params, p_dtype)))
    # a generator only for the outputs rounded stochastically (seeding one is not free)
    sr_param = masters is None and p_dtype in _SIXTEEN_BIT
    rng = [_bit_generator(tuple(random_key) + (i,)) if stochastic_rounding and used else None
           for i, used in enumerate((m_dtype in _SIXTEEN_BIT, v_dtype in _SIXTEEN_BIT, sr_param))]
    for pieces in _block_pieces(sizes):
        # this block's inputs are read into fresh arrays before its outputs overwrite them
        g, w, m, v = (_to_float32(_gather(views, pieces), dtype) for views, dtype in (
            (g_views, g_dtype), (w_views, w_dtype), (m_views, m_dtype), (v_views, v_dtype)))
        beta1, one_minus_beta1, beta2, one_minus_beta2, epsilon, decay, bias2_rsqrt, neg_step = \
            _block_hyper(hyper, pieces)
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
        _scatter(_rounded(m, m_dtype, rng[0]), m_views, pieces)
        _scatter(_rounded(v, v_dtype, rng[1]), v_views, pieces)
        if masters is not None:
            _scatter(w, w_views, pieces)
            _scatter(_rounded(w, p_dtype, None), p_views, pieces)
        else:
            _scatter(_rounded(w, p_dtype, rng[2]), p_views, pieces)


def adamw_step_ref(param: paddle.Tensor, grad: paddle.Tensor, exp_avg: paddle.Tensor,
                   exp_avg_sq: paddle.Tensor, master: Optional[paddle.Tensor], hyper: Sequence[float],
                   stochastic_rounding: bool = False, random_key: Sequence[int] = (0, 0)) -> None:
    """One AdamW step of one parameter, in place: ``adamw_multi_tensor_ref`` of a group of one, with
    ``hyper`` its 8 scalars."""
    adamw_multi_tensor_ref([param], [grad], [exp_avg], [exp_avg_sq], None if master is None else [master],
                           np.asarray(hyper, dtype=np.float32).reshape(1, -1), stochastic_rounding, random_key)
