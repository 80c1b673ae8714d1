"""Multi-tensor AdamW: one launch updates every parameter of a dtype group.

For each tensor ``i`` of the group (parameters of any shapes, each contiguous, flattened):

    w  = master_i (fp32) if the group keeps master weights, else param_i upcast to fp32
    w  = w * decay_i                                     # decay_i = 1 - lr_i * weight_decay_i
    m  = beta1_i * m + (1 - beta1_i) * g
    v  = beta2_i * v + (1 - beta2_i) * g * g
    w  = w + m / (sqrt(v) * bias2_rsqrt_i + eps_i) * neg_step_i
                                                         # bias2_rsqrt_i = 1 / sqrt(1 - beta2_i^t)
                                                         # neg_step_i    = -lr_i / (1 - beta1_i^t)
    param_i, m, v, master_i <- w, m, v, w  (cast to their dtypes)

This is ``paddle.optimizer.AdamW``'s update (decoupled weight decay applied to the weight before the
Adam step, bias correction from per-parameter ``beta^t``) in fp32 whatever the storage dtypes.
The per-tensor scalars come precomputed on the host (``hyper_rows``): they change with the learning
rate schedule and the step, and computing them once per tensor keeps the kernel's fp32 arithmetic
identical to the reference path's.

Memory-bound. Each byte is read once and written once: with bf16 params and grads, fp32 master
weights and bf16 moments, 12 B in + 10 B out = 22 B per parameter. No per-tensor launches: the host
builds three small tables per group,

    chunk_tensor  int32 [n_chunks]      which tensor each program's chunk belongs to
    offsets       int64 [n, 8]          element offsets of param/grad/exp_avg/exp_avg_sq/master
                                        from the group's first tensor of each kind (so the kernel
                                        gets typed base pointers), numel, first chunk, unused
    hyper         fp32  [n, 8]          the per-tensor scalars of HYPER_FIELDS

and one program updates one chunk (BLOCK * ITERS elements) of one tensor, BLOCK elements at a time:
its table look-ups are paid once per chunk. Whole blocks take an unmasked path, so loads and stores
are 16-byte vectors (the offsets are hinted as 16-byte multiples when every address is); the rest of
a tensor's last chunk goes masked, one element per thread. Registers are capped (MAXNREG) so that 8
programs share an SM: the latency of one program's loads hides behind the others' work.

16-bit outputs (moments, and parameters that have no master weight) can be rounded stochastically:
round to the neighbour of larger magnitude with probability (|x| - |lo|) / (|hi| - |lo|), so the
stored value is unbiased, using 16 random bits per value from Triton's Philox keyed by a 64-bit step
seed (bf16: add them below the 16 kept bits and truncate). One Philox call yields 4 x 32 bits: the
words of one call serve 4 consecutive elements, each word's low and high halves the two moments;
parameters draw from a second stream.

Compiled, sqrt and division are the hardware's approximate ones (<= 2 ulp); in the interpreter
they are exact, and with round-to-nearest storage the kernel equals ``reference/adamw.py`` bit for
bit there.
"""

from __future__ import annotations

from typing import Optional, Sequence, Tuple

import numpy as np
import triton
import triton.language as tl

from ...runtime import tensor as T

BLOCK = 1024  # elements a program updates at a time (8 per thread with 4 warps: one 16-byte bf16 vector)
ITERS = 8  # blocks per program: the table look-ups of a program serve BLOCK * ITERS elements
NUM_WARPS = 4
MAXNREG = 64  # registers per thread: 8 programs of 4 warps resident per SM (unbounded, ptxas takes ~96)
OFFSET_COLS = 8  # param, grad, exp_avg, exp_avg_sq, master, numel, first_chunk, (unused)
HYPER_FIELDS = ("beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "epsilon", "decay",
                "bias2_rsqrt", "neg_step")
MOMENT_DTYPES = ("float32", "bfloat16", "float16")
_ALIGN_BYTES = 16


@triton.jit
def _nearest(x, DTYPE: tl.constexpr):
    """fp32 ``x`` to ``DTYPE``, round to nearest even. bf16 by integer arithmetic on the bits (NaN
    kept NaN): the same rounding compiled and in the interpreter, whose float->bf16 cast truncates."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        out = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        out = x.to(DTYPE)
    return out


@triton.jit
def _stochastic_round(x, r16, DTYPE: tl.constexpr):
    """fp32 ``x`` to the 16-bit ``DTYPE``, unbiased, with ``r16`` uniform in [0, 2^16): rounds to the
    neighbour of larger magnitude with probability (|x| - |lo|) / (|hi| - |lo|).

    bfloat16: add r16 to the low 16 bits of x and truncate them (the carry happens with exactly that
    probability). float16: ``lo``/``hi`` are the representable neighbours around x (the nearest value
    and its neighbour one bit-pattern step toward or away from zero); hi is taken when
    ``u * |hi - lo| < |x - lo|``, u = r16 / 2^16. NaN and inf stay as they are; finite values past
    the largest finite one round to it or, in bfloat16, to inf."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + r16) >> 16
        out = tl.where(x != x, 0x7FC0, rounded).to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        nearest = _nearest(x, DTYPE)
        nearest32 = nearest.to(tl.float32)
        toward_zero = tl.abs(nearest32) > tl.abs(x)  # nearest lies beyond x: the other neighbour is inside
        step = tl.where(toward_zero, -1, 1).to(tl.int16)
        neighbour = (nearest.to(tl.int16, bitcast=True) + step).to(DTYPE, bitcast=True).to(tl.float32)
        lo = tl.where(toward_zero, neighbour, nearest32)
        hi = tl.where(toward_zero, nearest32, neighbour)
        u = r16.to(tl.float32) * (1.0 / 65536.0)
        out = _nearest(tl.where(u * tl.abs(hi - lo) < tl.abs(x - lo), hi, lo), DTYPE)
    return out


@triton.jit
def _random_words(seed, counter_start, stream, SIZE: tl.constexpr):
    """SIZE uint32 random words: Philox with counter (counter_start + i, stream), key = seed; one
    call gives the words of 4 elements."""
    QUARTER: tl.constexpr = SIZE // 4
    counter = counter_start + tl.arange(0, QUARTER)
    c_lo = counter.to(tl.uint32)
    c_hi = (counter >> 32).to(tl.uint32)
    c_stream = c_lo * 0 + stream.to(tl.uint32)
    r0, r1, r2, r3 = tl.philox(seed, c_lo, c_hi, c_stream, c_lo * 0)
    return tl.reshape(tl.join(tl.join(r0, r1), tl.join(r2, r3)), [SIZE])


@triton.jit
def _tensor_base(base, row, COL: tl.constexpr, ALIGNED: tl.constexpr):
    """Pointer to the first element of the tensor whose offset from ``base`` is row[COL]."""
    off = tl.load(row + COL)
    if ALIGNED:
        VEC: tl.constexpr = 8 * 16 // base.dtype.element_ty.primitive_bitwidth  # elements in 16 bytes
        off = tl.multiple_of(off, VEC)
    return base + off


@triton.jit
def _load(ptrs, mask, MASKED: tl.constexpr):
    """Streamed once: evict first. Masked lanes read 0 (harmless through the update)."""
    if MASKED:
        x = tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first")
    else:
        x = tl.load(ptrs, eviction_policy="evict_first")
    return x


@triton.jit
def _store(ptrs, x, mask, MASKED: tl.constexpr):
    if MASKED:
        tl.store(ptrs, x, mask=mask)
    else:
        tl.store(ptrs, x)


@triton.jit
def _adamw_block(p_ptr, g_ptr, m_ptr, v_ptr, w_ptr, n_valid, counter_start, hyper, seed, stream,
                 HAS_MASTER: tl.constexpr, SR_MOMENTS: tl.constexpr, SR_PARAM: tl.constexpr,
                 MASKED: tl.constexpr, SIZE: tl.constexpr):
    """Update SIZE consecutive elements starting at the given pointers (the first ``n_valid`` of
    them when MASKED). ``hyper``: the 8 scalars of HYPER_FIELDS."""
    beta1, one_minus_beta1, beta2, one_minus_beta2, epsilon, decay, bias2_rsqrt, neg_step = hyper
    idx = tl.arange(0, SIZE)
    mask = idx < n_valid
    if SR_MOMENTS:  # drawn before the loads: fewer values live at once
        words = _random_words(seed, counter_start, stream, SIZE)
    g = _load(g_ptr + idx, mask, MASKED).to(tl.float32)
    m = _load(m_ptr + idx, mask, MASKED).to(tl.float32)
    v = _load(v_ptr + idx, mask, MASKED).to(tl.float32)
    if HAS_MASTER:
        w = _load(w_ptr + idx, mask, MASKED)
    else:
        w = _load(p_ptr + idx, mask, MASKED).to(tl.float32)

    w = w * decay
    m = beta1 * m + one_minus_beta1 * g
    v = beta2 * v + one_minus_beta2 * g * g
    # compiled: approximate sqrt and division (<= 2 ulp; the IEEE ones cost a third more instructions
    # and ~30 registers); in the interpreter both are exact, as in the reference
    denom = tl.sqrt(v) * bias2_rsqrt + epsilon
    w = w + m / denom * neg_step

    if SR_MOMENTS:
        m_out = _stochastic_round(m, words & 0xFFFF, m_ptr.dtype.element_ty)
        v_out = _stochastic_round(v, words >> 16, v_ptr.dtype.element_ty)
    else:
        m_out = _nearest(m, m_ptr.dtype.element_ty)
        v_out = _nearest(v, v_ptr.dtype.element_ty)
    _store(m_ptr + idx, m_out, mask, MASKED)
    _store(v_ptr + idx, v_out, mask, MASKED)
    if HAS_MASTER:
        _store(w_ptr + idx, w, mask, MASKED)
        _store(p_ptr + idx, _nearest(w, p_ptr.dtype.element_ty), mask, MASKED)
    elif SR_PARAM:
        param_words = _random_words(seed, counter_start, stream + 1, SIZE)
        _store(p_ptr + idx, _stochastic_round(w, param_words & 0xFFFF, p_ptr.dtype.element_ty), mask, MASKED)
    else:
        _store(p_ptr + idx, _nearest(w, p_ptr.dtype.element_ty), mask, MASKED)


@triton.jit(do_not_specialize=["seed", "stream"])
def _adamw_multi_tensor_kernel(chunk_tensor_ptr, offsets_ptr, hyper_ptr,
                               param_ptr, grad_ptr, exp_avg_ptr, exp_avg_sq_ptr, master_ptr, seed, stream,
                               HAS_MASTER: tl.constexpr, SR_MOMENTS: tl.constexpr, SR_PARAM: tl.constexpr,
                               ALIGNED: tl.constexpr, BLOCK: tl.constexpr, ITERS: tl.constexpr,
                               TAIL: tl.constexpr):
    """One program: a chunk of BLOCK * ITERS elements of one tensor. Whole blocks of BLOCK go
    unmasked in 16-byte vectors; what is left of the tensor's last chunk (< BLOCK elements) goes
    masked, TAIL elements at a time (one per thread: few registers, so the main loop keeps its
    occupancy)."""
    CHUNK: tl.constexpr = BLOCK * ITERS
    pid = tl.program_id(0)
    tensor = tl.load(chunk_tensor_ptr + pid).to(tl.int64)
    row = offsets_ptr + tensor * 8
    numel = tl.load(row + 5)
    chunk_start = (pid - tl.load(row + 6)) * CHUNK
    p_ptr = _tensor_base(param_ptr, row, 0, ALIGNED) + chunk_start
    g_ptr = _tensor_base(grad_ptr, row, 1, ALIGNED) + chunk_start
    m_ptr = _tensor_base(exp_avg_ptr, row, 2, ALIGNED) + chunk_start
    v_ptr = _tensor_base(exp_avg_sq_ptr, row, 3, ALIGNED) + chunk_start
    w_ptr = _tensor_base(master_ptr, row, 4, ALIGNED) + chunk_start
    h = hyper_ptr + tensor * 8
    hyper = (tl.load(h + 0), tl.load(h + 1), tl.load(h + 2), tl.load(h + 3), tl.load(h + 4), tl.load(h + 5),
             tl.load(h + 6), tl.load(h + 7))
    counter = pid.to(tl.int64) * (CHUNK // 4)  # Philox counters of this chunk: CHUNK / 4 of them

    # Loops of constant trip count with guards, not unrolled: one block's values live at a time. (Run-time
    # bounds work in the interpreter now, but change the compiled code: switch with a GPU-verified run.)
    n = tl.minimum(numel - chunk_start, CHUNK)  # elements of this chunk
    n_full = n // BLOCK
    for i in tl.range(ITERS, loop_unroll_factor=1):
        if i < n_full:
            _adamw_block(p_ptr + i * BLOCK, g_ptr + i * BLOCK, m_ptr + i * BLOCK, v_ptr + i * BLOCK,
                         w_ptr + i * BLOCK, BLOCK, counter + i * (BLOCK // 4), hyper, seed, stream, HAS_MASTER,
                         SR_MOMENTS, SR_PARAM, False, BLOCK)
    done = n_full * BLOCK
    for j in tl.range(BLOCK // TAIL, loop_unroll_factor=1):
        start = done + j * TAIL
        if start < n:
            _adamw_block(p_ptr + start, g_ptr + start, m_ptr + start, v_ptr + start, w_ptr + start, n - start,
                         counter + start // 4, hyper, seed, stream, HAS_MASTER, SR_MOMENTS, SR_PARAM, True, TAIL)


# ----------------------------------------------------------------------------------------------
# host side: tables (numpy) and the launcher


def _lists(params, grads, exp_avgs, exp_avg_sqs, masters):
    kinds = [("params", params), ("grads", grads), ("exp_avgs", exp_avgs), ("exp_avg_sqs", exp_avg_sqs)]
    if masters is not None:
        kinds.append(("masters", masters))
    n = len(params)
    if n == 0:
        raise ValueError("params: expected at least one tensor, got an empty list")
    for name, tensors in kinds:
        if len(tensors) != n:
            raise ValueError(f"{name}: expected {n} tensors (one per parameter), got {len(tensors)}")
        dtypes = {T.dtype_name(t) for t in tensors}
        if len(dtypes) != 1:
            raise TypeError(f"{name}: one launch takes tensors of one dtype, got {sorted(dtypes)}")
    return kinds


def check_group(params, grads, exp_avgs, exp_avg_sqs, masters=None) -> None:
    """Dtypes and shapes of one launch group; every tensor contiguous."""
    kinds = _lists(params, grads, exp_avgs, exp_avg_sqs, masters)
    dtype = dict((name, T.dtype_name(ts[0])) for name, ts in kinds)
    for name in ("params", "grads"):
        if dtype[name] not in T.FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype in {list(T.FLOAT_DTYPES)}, got {dtype[name]}")
    for name in ("exp_avgs", "exp_avg_sqs"):
        if dtype[name] not in MOMENT_DTYPES:
            raise TypeError(f"{name}: expected dtype in {list(MOMENT_DTYPES)}, got {dtype[name]}")
    if masters is not None and dtype["masters"] != "float32":
        raise TypeError(f"masters: expected float32 master weights, got {dtype['masters']}")
    for i, p in enumerate(params):
        for name, tensors in kinds:
            t = tensors[i]
            if T.numel(t) != T.numel(p):
                raise ValueError(f"{name}[{i}]: expected {T.numel(p)} elements like params[{i}] "
                                 f"{T.shape(p)}, got shape {T.shape(t)}")
            T.check_contiguous(f"{name}[{i}]", t)


def plan_chunks(numels: Sequence[int], chunk: int = BLOCK * ITERS) -> Tuple[np.ndarray, np.ndarray]:
    """(chunk_tensor int32 [n_chunks], first_chunk int64 [n]) for tensors of ``numels`` elements cut
    into chunks of ``chunk`` elements, one program each."""
    numels = np.asarray(numels, dtype=np.int64)
    counts = (numels + chunk - 1) // chunk
    first_chunk = np.concatenate([[0], np.cumsum(counts)[:-1]]).astype(np.int64)
    if counts.sum() >= 2**31:
        raise ValueError(f"params: {int(numels.sum())} elements need {int(counts.sum())} chunks of {chunk}, "
                         "past the grid limit 2^31 - 1: split the group")
    return np.repeat(np.arange(len(numels), dtype=np.int32), counts), first_chunk


def offsets_table(params, grads, exp_avgs, exp_avg_sqs, masters, first_chunk) -> np.ndarray:
    """int64 [n, OFFSET_COLS]: element offsets of every tensor from the first of its kind, numel,
    first chunk. Raises if an address is not a whole number of elements from its base."""
    kinds = _lists(params, grads, exp_avgs, exp_avg_sqs, masters)
    n = len(params)
    table = np.zeros((n, OFFSET_COLS), dtype=np.int64)
    for col, (name, tensors) in enumerate(kinds):
        size = T.itemsize(tensors[0])
        addrs = np.array([t.data_ptr() for t in tensors], dtype=np.int64)
        delta = addrs - addrs[0]
        if np.any(delta % size):
            raise ValueError(f"{name}: addresses must be whole {T.dtype_name(tensors[0])} elements apart")
        table[:, col] = delta // size
    table[:, 5] = [T.numel(p) for p in params]
    table[:, 6] = first_chunk
    return table


def all_aligned(*tensor_lists) -> bool:
    """Every tensor starts on a 16-byte boundary (so 16-byte vector accesses are legal)."""
    return all(t.data_ptr() % _ALIGN_BYTES == 0 for ts in tensor_lists if ts is not None for t in ts)


def table_aligned(offsets: np.ndarray, params, grads, exp_avgs, exp_avg_sqs, masters) -> bool:
    """``all_aligned`` of the lists from their ``offsets_table`` and the 5 first tensors: O(1) Python
    calls, for callers that launch every step."""
    kinds = [params, grads, exp_avgs, exp_avg_sqs] + ([masters] if masters is not None else [])
    for col, tensors in enumerate(kinds):
        size = T.itemsize(tensors[0])
        if tensors[0].data_ptr() % _ALIGN_BYTES or np.any(offsets[:, col] * size % _ALIGN_BYTES):
            return False
    return True


def hyper_rows(lr, weight_decay, beta1, beta2, epsilon, beta1_pow, beta2_pow) -> np.ndarray:
    """float32 [n, 8] in HYPER_FIELDS order from per-tensor arrays (or scalars broadcast):
    ``lr`` the effective learning rate (schedule x group scale x lr_ratio), ``weight_decay`` 0 where
    no decay applies, ``beta*_pow`` = beta^t of this step. The inputs are taken as float32 values
    (as Paddle holds them: 1 - beta is then 1 - float32(beta)), the derived scalars computed in
    float64 and rounded once."""
    columns = np.broadcast_arrays(*[np.asarray(a, dtype=np.float32) for a in (
        lr, weight_decay, beta1, beta2, epsilon, beta1_pow, beta2_pow)])
    return np.atleast_2d(hyper_table(np.stack(columns, axis=-1)))


def hyper_table(values) -> np.ndarray:
    """``hyper_rows`` of ``values`` [..., 7]: its arguments side by side, one row a tensor (one array
    in, so that a caller with a row per tensor, such as the optimizer each step, spends few calls)."""
    lr, wd, b1, b2, eps, b1p, b2p = np.asarray(values, dtype=np.float32).astype(np.float64).T
    rows = np.array((b1, 1.0 - b1, b2, 1.0 - b2, eps, 1.0 - lr * wd, 1.0 / np.sqrt(1.0 - b2p), -lr / (1.0 - b1p)),
                    dtype=np.float32)
    return np.ascontiguousarray(rows.T)


def step_seed(base_seed: int, step: int) -> int:
    """The 64-bit Philox key of one step: step in the high word (>= 1, so the value always passes
    as int64 and one compiled kernel serves every step), base seed in the low word."""
    if step < 1 or step >= 2**31:
        raise ValueError(f"step: expected 1 <= step < 2^31, got {step}")
    return (int(step) << 32) | (int(base_seed) & 0xFFFFFFFF)


def adamw_multi_tensor(params, grads, exp_avgs, exp_avg_sqs, masters, chunk_tensor, offsets, hyper,
                       seed: int = 1 << 32, stream: int = 0, stochastic_rounding: bool = False,
                       block: int = BLOCK, iters: int = ITERS, num_warps: int = NUM_WARPS,
                       maxnreg: int = MAXNREG, validate: bool = True, aligned: Optional[bool] = None) -> None:
    """One AdamW step over a group, in place (params, exp_avgs, exp_avg_sqs, masters are written).

    params/grads/exp_avgs/exp_avg_sqs/masters: lists of n contiguous tensors, one dtype per list
    (masters None when the group has no master weights). chunk_tensor int32 [n_chunks], offsets
    int64 [n, 8] and hyper fp32 [n, 8]: device copies of ``plan_chunks(numels, block * iters)[0]``,
    ``offsets_table(<these lists>, first_chunk)`` and ``hyper_rows(...)``. ``seed``:
    ``step_seed(...)``; ``stream``: distinguishes the launches of one step (e.g. 2 x group index) so
    no two draw the same random numbers. ``stochastic_rounding``: 16-bit moments, and 16-bit params
    without master, round stochastically; else to nearest-even. ``block``/``iters``/``num_warps``/
    ``maxnreg``: launch configuration (``block`` a power of two >= 32 * num_warps).

    Per step, the Python cost of checking every tensor (``check_group``, ~5 us a tensor) and of
    reading every address for the alignment can exceed the kernel's time: a caller that launches
    the same group every step validates it once, checks what changes (the grads) itself, and
    passes ``validate=False`` and ``aligned=table_aligned(<offsets table>, ...)``.
    """
    if validate:
        check_group(params, grads, exp_avgs, exp_avg_sqs, masters)
    n = len(params)
    if block < 32 * num_warps or block & (block - 1) or iters < 1:
        raise ValueError(f"block, iters: expected a power of two block >= 32 * num_warps and iters >= 1, got "
                         f"{block}, {iters}")
    if T.dtype_name(chunk_tensor) != "int32" or len(T.shape(chunk_tensor)) != 1:
        raise TypeError(f"chunk_tensor: expected int32 [n_chunks], got {T.dtype_name(chunk_tensor)} "
                        f"{T.shape(chunk_tensor)}")
    for name, table, dtype in (("offsets", offsets, "int64"), ("hyper", hyper, "float32")):
        if T.dtype_name(table) != dtype or T.shape(table) != (n, 8):
            raise TypeError(f"{name}: expected {dtype} [{n}, 8], got {T.dtype_name(table)} {T.shape(table)}")
    n_chunks = T.shape(chunk_tensor)[0]
    if n_chunks == 0:
        return
    has_master = masters is not None
    sixteen_bit = ("float16", "bfloat16")
    sr_moments = stochastic_rounding and T.dtype_name(exp_avgs[0]) in sixteen_bit \
        and T.dtype_name(exp_avg_sqs[0]) in sixteen_bit
    if stochastic_rounding and not sr_moments and T.dtype_name(exp_avgs[0]) != T.dtype_name(exp_avg_sqs[0]):
        raise TypeError("exp_avgs/exp_avg_sqs: stochastic rounding needs both moments 16-bit or both float32")
    sr_param = stochastic_rounding and not has_master and T.dtype_name(params[0]) in sixteen_bit
    if aligned is None:
        aligned = all_aligned(params, grads, exp_avgs, exp_avg_sqs, masters)
    master_base = masters[0] if has_master else exp_avgs[0]  # unused when there is no master
    _adamw_multi_tensor_kernel[(n_chunks,)](
        chunk_tensor, offsets, hyper, params[0], grads[0], exp_avgs[0], exp_avg_sqs[0], master_base,
        int(seed), int(stream), HAS_MASTER=has_master, SR_MOMENTS=sr_moments, SR_PARAM=sr_param,
        ALIGNED=aligned, BLOCK=block, ITERS=iters, TAIL=32 * num_warps, num_warps=num_warps, maxnreg=maxnreg)


def compile_cases():
    """Compile-only check: every storage combination the optimizer launches, with 3 tensors."""
    shapes = [(4096, 11), (7,), (3, 4096)]
    n_chunks = len(plan_chunks([int(np.prod(s)) for s in shapes])[0])
    combos = [("bfloat16", "bfloat16", "bfloat16", True, True), ("bfloat16", "bfloat16", "float32", True, False),
              ("float16", "float16", "float16", True, True), ("float32", "float32", "bfloat16", False, True),
              ("float32", "float32", "float32", False, False), ("bfloat16", "bfloat16", "bfloat16", False, True),
              ("bfloat16", "float32", "bfloat16", True, True), ("float16", "float16", "float32", False, False)]
    for param_dtype, grad_dtype, moment_dtype, master, sr in combos:
        def launch(pd=param_dtype, gd=grad_dtype, md=moment_dtype, master=master, sr=sr):
            make = lambda dtype: [T.SpecTensor(s, dtype) for s in shapes]  # noqa: E731
            adamw_multi_tensor(make(pd), make(gd), make(md), make(md), make("float32") if master else None,
                               T.SpecTensor((n_chunks,), "int32"), T.SpecTensor((len(shapes), 8), "int64"),
                               T.SpecTensor((len(shapes), 8), "float32"), stochastic_rounding=sr)
        yield f"adamw[param={param_dtype},grad={grad_dtype},moments={moment_dtype},master={master},sr={sr}]", launch
