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

``KernelGroup`` is FusedAdamW's CPU step where that exact arithmetic is not needed and Paddle has a
kernel: float32 params and grads (no masters) go through Paddle's own multi-tensor AdamW
(``fused_adam_``, one C++ pass an element, where the numpy update makes some 25), its 16-bit
moments through float32 scratch with the same stochastic rounding. AdamW's update within float32
rounding, not the Triton kernel's bits.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np
import paddle
from paddle import _C_ops

_SIXTEEN_BIT = ("float16", "bfloat16")
_BF16_NAN = np.uint16(0x7FC0)
_HOST_DTYPES = {"float32": np.dtype(np.float32), "int32": np.dtype(np.int32), "float16": np.dtype(np.uint16),
                "bfloat16": np.dtype(np.uint16)}


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


def _nearest_bits(x: np.ndarray, dtype: str, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Bit patterns of fp32 ``x`` rounded to the 16-bit ``dtype``, to nearest even; bf16 NaN -> 0x7FC0
    (the kernel's ``_nearest``). Written into ``out`` (uint16, x's size) when given."""
    out = np.empty(x.size, np.uint16) if out is None else out
    if x.size == 0:
        return out
    if dtype == "bfloat16":
        # adding 0x7FFF plus the kept part's lowest bit carries into the kept 16 bits exactly when
        # the dropped 16 bits round up (ties to even); uint32 passes in place (few, contiguous)
        bits = x.view(np.uint32)
        total = np.right_shift(bits, 16)
        total &= 1
        total += 0x7FFF
        total += bits
        total >>= 16
        np.copyto(out, total, casting="unsafe")
        if np.isnan(x.max()):  # (max is NaN iff x holds one)
            out[np.isnan(x)] = _BF16_NAN
        return out
    with np.errstate(over="ignore"):  # beyond float16's range: inf, as the kernel's cast
        np.copyto(out.view(np.float16), x, casting="unsafe")
    return out


# |x| from here on (largest finite bf16's bit pattern, as float32) are _stochastic_bits' edge cases
_BF16_EDGE = np.uint32(0x7F7F0000).view(np.float32)


def _stochastic_bits(x: np.ndarray, dtype: str, r16: np.ndarray, out: Optional[np.ndarray] = None) -> np.ndarray:
    """Bit patterns of fp32 ``x`` rounded to the 16-bit ``dtype``: the neighbour of larger magnitude
    ``hi`` when ``u * |hi - lo| < |x - lo|`` (``lo`` the other neighbour, ``u = r16 / 2^16``, ``r16``
    uniform in [0, 2^16)), else ``lo``. Unbiased except where hi is inf: finite values stay finite.
    Written into ``out`` (uint16, x's size) when given."""
    out = np.empty(x.size, np.uint16) if out is None else out
    if x.size == 0:
        return out
    if dtype == "bfloat16":
        # lo is x truncated to its 16 high bits, |hi - lo| one bf16 ulp and |x - lo| the 16 low bits
        # in units of 2^-16 of it, all exact: hi iff r16 < low bits, iff adding 0xFFFF - r16 carries
        bits = x.view(np.uint32)
        total = np.subtract(np.uint32(0xFFFF), r16, dtype=np.uint32)
        total += bits
        total >>= 16
        np.copyto(out, total, casting="unsafe")
        # lo the largest finite (u * inf is never < |x - lo|), inf, NaN: max and min (NaN if x holds one)
        # rule them out in two reductions
        if not (x.max() < _BF16_EDGE and x.min() > -_BF16_EDGE):
            edge = (bits & 0x7FFFFFFF) >= 0x7F7F0000
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
    np.copyto(out.view(np.float16), np.where(up, hi, lo), casting="unsafe")
    return out


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


def _round_into(values: np.ndarray, dtype: str, rng: Optional[np.random.SFC64], out=None) -> np.ndarray:
    """fp32 ``values`` as 16-bit ``dtype`` bit patterns (into ``out`` when given), stochastically
    when ``rng``."""
    if rng is None:
        return _nearest_bits(values, dtype, out)
    return _stochastic_bits(values, dtype, _random16(rng, values.size), out)


# Elements per pass: the temporaries stay in cache and in malloc's heap (fresh multi-megabyte arrays
# fault their pages in, which cost more than the arithmetic). A multiple of 4, so random streams
# continue from block to block.
_BLOCK = 1 << 15


def _block_pieces(sizes: Sequence[int], block: int = _BLOCK):
    """The group's elements in order cut into blocks of ``block``: for each block, its pieces
    (tensor index, start, stop) within the tensors it covers."""
    pieces, room = [], block
    for i, size in enumerate(sizes):
        start = 0
        while start < size:
            stop = min(size, start + room)
            pieces.append((i, start, stop))
            room -= stop - start
            start = stop
            if room == 0:
                yield pieces
                pieces, room = [], block
    if pieces:
        yield pieces


def _load(views: Sequence[np.ndarray], pieces, dtype: str) -> np.ndarray:
    """A block's values of one kind in float32: where the block lies in one float32 tensor, that
    tensor's memory itself (updating it in place updates the tensor), else a fresh array."""
    if len(pieces) == 1:
        i, start, stop = pieces[0]
        values = views[i][start:stop]
    else:
        values = np.concatenate([views[i][start:stop] for i, start, stop in pieces])
    if dtype == "bfloat16":
        return np.left_shift(values, 16, dtype=np.uint32).view(np.float32)
    if dtype == "float16":
        return values.view(np.float16).astype(np.float32)
    return values


def _store(values: np.ndarray, views: Sequence[np.ndarray], pieces, dtype: str, rng: Optional[np.random.SFC64],
           in_place: bool) -> None:
    """Write a block's fp32 ``values`` into the tensors of one kind, rounded for 16-bit ``dtype``
    (stochastically when ``rng``). ``in_place``: ``values`` is that memory already (``_load``'s)."""
    if in_place:
        return
    if len(pieces) == 1:
        i, start, stop = pieces[0]
        if dtype in _SIXTEEN_BIT:
            _round_into(values, dtype, rng, out=views[i][start:stop])
        else:
            views[i][start:stop] = values
        return
    _scatter(_round_into(values, dtype, rng) if dtype in _SIXTEEN_BIT else values, views, pieces)


def _scatter(values: np.ndarray, views: Sequence[np.ndarray], pieces) -> None:
    """A block's ``values`` (or bit patterns) into its pieces (tensor index, start, stop) of ``views``."""
    at = 0
    for i, start, stop in pieces:
        views[i][start:stop] = values[at:at + stop - start]
        at += stop - start


def _block_hyper(rows: np.ndarray, shared: list, pieces) -> list:
    """The 8 scalars of the block's elements: ``shared[k]`` where every tensor of the group has the
    same value (float32 scalar, else None), else a scalar where the block's tensors share it, else one
    per element (the arithmetic is the same elementwise, so all round alike)."""
    if all(value is not None for value in shared):
        return shared
    members = rows[[i for i, _, _ in pieces]]
    same = (members == members[0]).all(axis=0)
    counts = [stop - start for _, start, stop in pieces]
    return [value if value is not None else members[0, k] if same[k] else np.repeat(members[:, k], counts)
            for k, value in enumerate(shared)]


def _dtype_of(name: str, tensors: Sequence[paddle.Tensor]) -> str:
    # compared as objects, by identity first (Paddle 3.3's dtypes are singletons; == is a
    # Python-level call): naming each tensor's dtype costs more
    dtype = tensors[0].dtype
    if any(t.dtype is not dtype and t.dtype != dtype for t in tensors):
        raise ValueError(f"adamw_multi_tensor_ref: {name} must share one dtype, got "
                         f"{sorted({_dtype_name(t) for t in tensors})}")
    return _dtype_name(tensors[0])


def _check_list(name: str, tensors: Sequence[paddle.Tensor], sizes: Sequence[int]) -> str:
    """``tensors`` on the CPU, contiguous, with ``sizes`` elements each and one dtype (returned)."""
    if not all(t.place.is_cpu_place() for t in tensors):
        raise ValueError(f"adamw_multi_tensor_ref: {name} must be CPU tensors here (HostGroup)")
    if any(_numel(t) != size for t, size in zip(tensors, sizes)):
        raise ValueError(f"adamw_multi_tensor_ref: {name} must have the params' numbers of elements")
    if not all(t.is_contiguous() for t in tensors):
        raise ValueError(f"adamw_multi_tensor_ref: {name} must be contiguous")
    return _dtype_of(name, tensors)


def _checked_hyper(hyper, n: int) -> np.ndarray:
    hyper = np.asarray(hyper, dtype=np.float32)
    if hyper.shape != (n, 8):
        raise ValueError(f"adamw_multi_tensor_ref: hyper: expected shape [{n}, 8], got {list(hyper.shape)}")
    return hyper


class _HeldGroup:
    """The tensor lists a prepared group holds (``_lists``: params, moments and, where held, masters)
    and their addresses when prepared (``_addresses``); ``_has_maxes``: the last list is AMSGrad's
    second-moment maxima."""

    _has_maxes = False

    @staticmethod
    def _addresses_of(lists) -> list:
        return [t.data_ptr() for ts in lists for t in ts]

    def describes(self, params, exp_avgs, exp_avg_sqs, masters, exp_avg_sq_maxs=None) -> bool:
        """Whether the group still stands for these lists: the same tensors at the same addresses."""
        lists = (params, exp_avgs, exp_avg_sqs) + ((masters,) if masters is not None else ()) + (
            (exp_avg_sq_maxs,) if exp_avg_sq_maxs is not None else ())
        if (exp_avg_sq_maxs is not None) != self._has_maxes:
            return False
        return len(lists) == len(self._lists) and all(
            len(ts) == len(held) and all(t is h for t, h in zip(ts, held)) for ts, held in zip(lists, self._lists)) \
            and self._addresses_of(lists) == self._addresses


class HostGroup(_HeldGroup):
    """``adamw_multi_tensor_ref``'s update of one group of CPU tensors, prepared for repeated steps:
    the params, moments and masters checked once and held with their flat numpy views and the
    group's blocks, so that a step costs the update rather than Python over the tensors. The views do
    not keep tensors alive: the group holds them. ``describes`` says whether it still stands for
    given lists (the same tensors at the same addresses). ``exp_avg_sq_maxs``: AMSGrad's running
    maxima of the second moments (as Paddle's AdamW(amsgrad=True): the step divides by the maximum),
    or None."""

    def __init__(self, params: Sequence[paddle.Tensor], exp_avgs: Sequence[paddle.Tensor],
                 exp_avg_sqs: Sequence[paddle.Tensor], masters: Optional[Sequence[paddle.Tensor]],
                 exp_avg_sq_maxs: Optional[Sequence[paddle.Tensor]] = None):
        self._has_maxes = exp_avg_sq_maxs is not None
        self._lists = tuple(list(ts) for ts in (params, exp_avgs, exp_avg_sqs)) + (
            (list(masters),) if masters is not None else ()) + ((list(exp_avg_sq_maxs),) if self._has_maxes else ())
        self.sizes = [_numel(p) for p in params]
        names = ("params", "exp_avgs", "exp_avg_sqs") + (("masters",) if masters is not None else ()) + (
            ("exp_avg_sq_maxs",) if self._has_maxes else ())
        self._dtypes = [_check_list(name, ts, self.sizes) for name, ts in zip(names, self._lists)]
        self._views = [[_flat(t, dtype) for t in ts] for ts, dtype in zip(self._lists, self._dtypes)]
        self._addresses = self._addresses_of(self._lists)
        self._blocks = list(_block_pieces(self.sizes))

    def step(self, grads: Sequence[paddle.Tensor], hyper: np.ndarray, stochastic_rounding: bool = False,
             random_key: Sequence[int] = (0, 0)) -> None:
        """One AdamW step with ``grads`` (CPU, the params' numbers of elements, one dtype; any
        strides); ``hyper``, ``stochastic_rounding`` and ``random_key`` as ``adamw_multi_tensor_ref``'s."""
        if len(grads) != len(self.sizes):
            raise ValueError(f"adamw_multi_tensor_ref: expected {len(self.sizes)} grads, got {len(grads)}")
        # held for the whole step: the numpy views below do not keep their tensors alive
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        g_dtype = _check_list("grads", grads, self.sizes)
        g_views = [_flat(g, g_dtype) for g in grads]
        p_dtype, m_dtype, v_dtype = self._dtypes[:3]
        p_views, m_views, v_views = self._views[:3]
        has_master = len(self._lists) - self._has_maxes == 4
        w_dtype, w_views = (self._dtypes[3], self._views[3]) if has_master else (p_dtype, p_views)
        x_dtype, x_views = (self._dtypes[-1], self._views[-1]) if self._has_maxes else (None, None)
        # a generator only for the outputs rounded stochastically (seeding one is not free)
        sr_param = not has_master and p_dtype in _SIXTEEN_BIT
        rng = [_bit_generator(tuple(random_key) + (i,)) if stochastic_rounding and used else None
               for i, used in enumerate((m_dtype in _SIXTEEN_BIT, v_dtype in _SIXTEEN_BIT, sr_param,
                                         x_dtype in _SIXTEEN_BIT))]
        hyper = _checked_hyper(hyper, len(self.sizes))
        shared = [column[0] if (column == column[0]).all() else None for column in hyper.T]
        for pieces in self._blocks:
            whole = len(pieces) == 1  # the block lies in one tensor: float32 memory is updated in place
            g, w, m, v = (_load(views, pieces, dtype) for views, dtype in (
                (g_views, g_dtype), (w_views, w_dtype), (m_views, m_dtype), (v_views, v_dtype)))
            beta1, one_minus_beta1, beta2, one_minus_beta2, epsilon, decay, bias2_rsqrt, neg_step = \
                _block_hyper(hyper, shared, pieces)
            # one rounding per operation, in the kernel's order (w * 1 is w: no decay, no product)
            if not (np.ndim(decay) == 0 and decay == 1):
                np.multiply(w, decay, out=w)
            np.multiply(m, beta1, out=m)
            term = np.multiply(g, one_minus_beta1)
            m += term
            np.multiply(v, beta2, out=v)
            np.multiply(g, one_minus_beta2, out=term)
            term *= g
            v += term
            if self._has_maxes:
                v_max = _load(x_views, pieces, x_dtype)
                np.maximum(v_max, v, out=v_max)
                _store(v_max, x_views, pieces, x_dtype, rng[3], whole and x_dtype == "float32")
                denom = np.sqrt(v_max, out=term)
            else:
                denom = np.sqrt(v, out=term)
            denom *= bias2_rsqrt
            denom += epsilon
            update = np.divide(m, denom, out=denom)
            update *= neg_step
            w += update
            _store(m, m_views, pieces, m_dtype, rng[0], whole and m_dtype == "float32")
            _store(v, v_views, pieces, v_dtype, rng[1], whole and v_dtype == "float32")
            _store(w, w_views, pieces, w_dtype, rng[2], whole and w_dtype == "float32")
            if has_master:
                _store(w, p_views, pieces, p_dtype, None, False)


# Elements of 16-bit moments KernelGroup widens to float32 at a time: its scratch (two such arrays)
# stays bounded whatever the group's size. A multiple of 4, so random streams continue across chunks.
_SCRATCH = 1 << 20


def _tensor_over(array: np.ndarray) -> paddle.Tensor:
    """A Paddle tensor on ``array``'s memory (zero-copy; it keeps the array alive)."""
    return paddle.utils.dlpack.from_dlpack(array.__dlpack__())


class KernelGroup(_HeldGroup):
    """FusedAdamW's update of a group of float32 CPU params with float32 grads and no master weights,
    on Paddle's multi-tensor AdamW kernel (``fused_adam_``: decoupled weight decay, bias correction
    from the given beta^t, one pass in C++ where HostGroup's numpy makes some 25). One call per set
    of tensors sharing (lr, weight decay, beta1, beta2, epsilon). 16-bit moments are widened into
    float32 scratch and rounded back in numpy, _SCRATCH elements at a time, from one SFC64 stream
    keyed by ``random_key`` (per chunk the first moment's draws, then the second's; HostGroup keys
    one stream per output: the two paths' random bits differ, their distribution not). The arithmetic
    is AdamW's, not the Triton kernel's rounding for rounding (Paddle folds the bias corrections
    into the step size and epsilon). ``describes`` as HostGroup's."""

    def __init__(self, params: Sequence[paddle.Tensor], exp_avgs: Sequence[paddle.Tensor],
                 exp_avg_sqs: Sequence[paddle.Tensor]):
        self._lists = (list(params), list(exp_avgs), list(exp_avg_sqs))
        self.sizes = [_numel(p) for p in params]
        dtypes = [_check_list(name, ts, self.sizes)
                  for name, ts in zip(("params", "exp_avgs", "exp_avg_sqs"), self._lists)]
        if dtypes[0] != "float32":
            raise ValueError(f"KernelGroup: expected float32 params, got {dtypes[0]}")
        self._moment_dtypes = dtypes[1:]
        self._addresses = self._addresses_of(self._lists)
        narrow = [dtype in _SIXTEEN_BIT for dtype in self._moment_dtypes]
        # float32 moments need no scratch: then one chunk of whole tensors
        self._chunks = list(_block_pieces(self.sizes, _SCRATCH if any(narrow) else max(1, sum(self.sizes))))
        pieces = [piece for chunk in self._chunks for piece in chunk]
        self._piece_tensor = np.array([i for i, _, _ in pieces], dtype=np.intp)
        # per piece: learning rate, beta1^t, beta2^t, which the kernel reads from [1] tensors on these
        self._scalars = np.zeros((len(pieces), 3), np.float32)
        scalar_tensors = [[_tensor_over(self._scalars[k, j:j + 1]) for j in range(3)] for k in range(len(pieces))]
        self._scratch = [np.empty(min(sum(self.sizes), _SCRATCH) if wide else 0, np.float32) for wide in narrow]
        moment_views = [[_flat(t, dtype) for t in ts] for ts, dtype in zip(self._lists[1:], self._moment_dtypes)]
        param_views = [_flat(p, "float32") for p in params]
        # per chunk: its pieces, their kernel arguments (param, moments, beta powers; grads come per
        # step), and per 16-bit moment the (moment view, scratch view) pairs of its pieces
        self._plans, first = [], 0
        for chunk in self._chunks:
            at, entries, pairs = 0, [], [[] for _ in narrow]
            for n, (i, start, stop) in enumerate(chunk):
                whole = start == 0 and stop == self.sizes[i]
                param = params[i] if whole else _tensor_over(param_views[i][start:stop])
                moments = []
                for k, ts in enumerate(self._lists[1:]):
                    if narrow[k]:
                        view = self._scratch[k][at:at + stop - start]
                        moments.append(_tensor_over(view.reshape(param.shape) if whole else view))
                        pairs[k].append((moment_views[k][i][start:stop], view.view(np.uint32)))
                    else:  # (whole tensors: one chunk)
                        moments.append(ts[i])
                entries.append((i, None if whole else (start, stop), param, *moments, scalar_tensors[first + n]))
                at += stop - start
            self._plans.append((chunk, at, entries, pairs))
            first += len(chunk)
        self._moment_views = moment_views
        self._sets_for: dict = {}

    def _sets(self, table: np.ndarray) -> list:
        """Per chunk, its pieces grouped by their tensors' (lr, decay, beta1, beta2, epsilon):
        [(those five, [entry index])]; kept per distinct table (schedulers change lr each step)."""
        key = table[:, :5].tobytes()
        sets = self._sets_for.get(key)
        if sets is None:
            rows = [tuple(row) for row in table[:, :5].tolist()]
            sets = []
            for _, _, entries, _ in self._plans:
                members: dict = {}
                for n, entry in enumerate(entries):
                    members.setdefault(rows[entry[0]], []).append(n)
                sets.append(list(members.items()))
            self._sets_for = {key: sets}  # (only the latest: a scheduler's tables never repeat)
        return sets

    def step(self, grads: Sequence[paddle.Tensor], table: np.ndarray, stochastic_rounding: bool = False,
             random_key: Sequence[int] = (0, 0)) -> None:
        """One AdamW step with float32 ``grads`` (CPU, the params' numbers of elements; any strides).
        ``table``: float32 [n, 7], row i tensor i's (lr, weight decay, beta1, beta2, epsilon,
        beta1^t, beta2^t) of this step."""
        if len(grads) != len(self.sizes):
            raise ValueError(f"KernelGroup: expected {len(self.sizes)} grads, got {len(grads)}")
        grads = [g if g.is_contiguous() else g.contiguous() for g in grads]
        if _check_list("grads", grads, self.sizes) != "float32":
            raise ValueError("KernelGroup: expected float32 grads")
        table = np.asarray(table, dtype=np.float32)
        if table.shape != (len(self.sizes), 7):
            raise ValueError(f"KernelGroup: table: expected shape [{len(self.sizes)}, 7], got {list(table.shape)}")
        self._scalars[:] = table[self._piece_tensor][:, [0, 5, 6]]
        narrow = [k for k, scratch in enumerate(self._scratch) if scratch.size]
        # one stream for both moments (seeding a generator costs a third to a half of a moment's
        # draws here): per chunk, the first moment's draws, then the second's
        rng = _bit_generator(tuple(random_key)) if stochastic_rounding and narrow else None
        for (chunk, size, entries, pairs), sets in zip(self._plans, self._sets(table)):
            for k in narrow:
                _widen(pairs[k], self._moment_dtypes[k], self._scratch[k][:size])
            for (_, weight_decay, beta1, beta2, epsilon), members in sets:
                picked = [entries[n] for n in members]
                gs = [grads[i] if piece is None else grads[i].reshape([-1])[piece[0]:piece[1]]
                      for i, piece, *_ in picked]
                # (chunk_size: the GPU kernel's launch granularity; use_adamw; no multi_precision;
                # use_global_beta_pow: the optimizer keeps beta^t, the kernel reads it)
                _C_ops.fused_adam_([e[2] for e in picked], gs, picked[0][5][0], [e[3] for e in picked],
                                   [e[4] for e in picked], None, [e[5][1] for e in picked], [e[5][2] for e in picked],
                                   None, None, beta1, beta2, epsilon, 65536, weight_decay, True, False, True, False)
            draws = None if rng is None else _random16(rng, len(narrow) * size)
            for j, k in enumerate(narrow):
                _narrow(self._scratch[k][:size], pairs[k], self._moment_views[k], chunk, self._moment_dtypes[k],
                        None if draws is None else draws[j * size:(j + 1) * size])


def _widen(pairs, dtype: str, out: np.ndarray) -> None:
    """16-bit values (bit patterns) into float32 scratch ``out``: (source view, scratch view as
    uint32) pairs, one copy each (numpy's call overhead is per piece, the shift per chunk)."""
    for bits, part in pairs:
        if dtype == "bfloat16":
            part[:] = bits
        else:
            np.copyto(part.view(np.float32), bits.view(np.float16))
    if dtype == "bfloat16":
        np.left_shift(out.view(np.uint32), 16, out=out.view(np.uint32))


def _narrow(values: np.ndarray, pairs, views, pieces, dtype: str, r16: Optional[np.ndarray]) -> None:
    """float32 scratch ``values`` back into the 16-bit tensors, rounded (stochastically with the
    uniform uint16 draws ``r16``, one per value, when given). bfloat16 without NaN, inf or values
    beyond the largest finite: adding the draw to the dropped 16 bits carries into the kept ones
    with probability (dropped bits) / 2^16, unbiased; in place, then each piece's high halves copied
    out. Else ``_stochastic_bits`` / ``_nearest_bits``."""
    if r16 is not None and dtype == "bfloat16" and values.max() < _BF16_EDGE and values.min() > -_BF16_EDGE:
        bits = values.view(np.uint32)
        np.add(bits, r16, out=bits)
        np.right_shift(bits, 16, out=bits)
        for out, part in pairs:
            np.copyto(out, part, casting="unsafe")
        return
    _scatter(_nearest_bits(values, dtype) if r16 is None else _stochastic_bits(values, dtype, r16), views, pieces)


@paddle.no_grad()
def adamw_multi_tensor_ref(params: Sequence[paddle.Tensor], grads: Sequence[paddle.Tensor],
                           exp_avgs: Sequence[paddle.Tensor], exp_avg_sqs: Sequence[paddle.Tensor],
                           masters: Optional[Sequence[paddle.Tensor]], hyper: np.ndarray,
                           stochastic_rounding: bool = False, random_key: Sequence[int] = (0, 0),
                           exp_avg_sq_maxs: Optional[Sequence[paddle.Tensor]] = None) -> None:
    """One AdamW step of a group of parameters, in place: params, exp_avgs, exp_avg_sqs (and masters,
    and AMSGrad's ``exp_avg_sq_maxs``: see ``HostGroup``) updated. The reference of
    ``adamw_multi_tensor``, with the same lists (one dtype per list, the params, exp_avgs,
    exp_avg_sqs and masters contiguous).

    ``hyper``: float32 [n, 8], row i the scalars of tensor i (module docstring). ``masters``: fp32
    weights of 16-bit params, or None (the params themselves are updated through fp32).
    ``stochastic_rounding``: 16-bit moments (and 16-bit params without master) round stochastically,
    each output with SFC64 seeded by ``random_key`` + (output index,) drawn over the group's elements
    in order (for one tensor, its elements). The group runs as one flat sequence of blocks, so a group
    of small tensors costs a few numpy calls per block rather than per tensor. For repeated steps of
    the same CPU tensors, ``HostGroup`` checks them and builds their views once.
    """
    n = len(params)
    optional = [ts for ts in (masters, exp_avg_sq_maxs) if ts is not None]
    lists = (params, grads, exp_avgs, exp_avg_sqs, *optional)
    if any(len(ts) != n for ts in lists):
        raise ValueError(f"adamw_multi_tensor_ref: expected {n} tensors in every list, got {[len(ts) for ts in lists]}")
    hyper = _checked_hyper(hyper, n)
    if n == 0:
        return
    if not all(t.place.is_cpu_place() for ts in lists for t in ts):  # through host copies
        host = [[t.cpu() for t in ts] for ts in lists]
        rest = iter(host[4:])
        adamw_multi_tensor_ref(*host[:4], next(rest) if masters is not None else None, hyper, stochastic_rounding,
                               random_key, next(rest) if exp_avg_sq_maxs is not None else None)
        for k, (ts, hs) in enumerate(zip(lists, host)):
            if k != 1:  # every list but the grads was written
                for t, h in zip(ts, hs):
                    paddle.assign(h._copy_to(t.place, True), output=t)
        return
    HostGroup(params, exp_avgs, exp_avg_sqs, masters, exp_avg_sq_maxs).step(grads, hyper, stochastic_rounding,
                                                                          random_key)


def adamw_step_ref(param: paddle.Tensor, grad: paddle.Tensor, exp_avg: paddle.Tensor,
                   exp_avg_sq: paddle.Tensor, master: Optional[paddle.Tensor], hyper: Sequence[float],
                   stochastic_rounding: bool = False, random_key: Sequence[int] = (0, 0)) -> None:
    """One AdamW step of one parameter, in place: ``adamw_multi_tensor_ref`` of a group of one, with
    ``hyper`` its 8 scalars."""
    adamw_multi_tensor_ref([param], [grad], [exp_avg], [exp_avg_sq], None if master is None else [master],
                           np.asarray(hyper, dtype=np.float32).reshape(1, -1), stochastic_rounding, random_key)
