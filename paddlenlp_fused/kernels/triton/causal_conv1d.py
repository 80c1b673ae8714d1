"""Depthwise causal conv1d (Mamba's short conv): forward, backward and the decoding update.

Shapes (``b`` batch, ``d`` dim, ``l`` seqlen, ``w`` width, any width >= 1):
    x, out, dout, dx     [b, d, l]   any strides (channel-first ``l`` contiguous, or channel-last
                                     ``d`` contiguous: the tile shape follows the contiguous axis)
    weight               [d, w];  bias [d]
    seq_idx              [b, l] int32/int64: positions with different ids never mix (packed batches);
                         a negative id is padding: its output is 0 and it passes no gradient
    initial_states       [b, d, w-1]: the inputs at positions -(w-1) .. -1 (zeros by default); they
                         continue the sequence of position 0

    out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (w-1) + k]),  act = identity or silu,
    where x at a position of another sequence (``seq_idx``) counts as 0, and out is 0 where seq_idx < 0
    (causal-conv1d's padding rule).

Memory-bound: both passes hold runs of CHUNK consecutive positions in a thread (16 bytes of a
channel-first row: vector loads and stores), so the shifted inputs a position needs are that
thread's registers plus the tail of the chunk before it, loaded again (an L1/L2 hit). The forward
reads x from DRAM once and writes out; the backward reads x and dout once, computes each
pre-activation and its silu' once, writes dx (and the initial states' gradient) and accumulates
dweight/dbias in registers over the program's tile, then adds them with one fp32 atomic per program,
dim and tap (``deterministic``: per-program partial sums in a workspace, then a fixed-order sum).

Decoding (``causal_conv1d_update``): x [b, d] or [b, d, s] new tokens; conv_state [b, d, state_len >=
w-1] holds the last inputs and is updated in place, either shifted (the last state_len inputs) or,
with ``cache_seqlens`` [b], as a circular buffer where token i goes to ``(cache_seqlens + i) % state_len``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime import tensor as T

ACTIVATIONS = {None: False, "silu": True, "swish": True}


# Tiles are [BLOCK_D, BLOCK_L] (dims x positions), as 3-D [BLOCK_D, BLOCK_L / CHUNK, CHUNK] in the
# chunked passes. Triton lays a tile out along whichever axis the strides make contiguous (seqlen
# for channel-first x, dim for channel-last), so every load and store is coalesced. Position-shifted
# inputs live in tuples indexed by compile-time shifts: the CHUNK slices of the chunks (``_unpack``),
# or, for the few positions of the initial states' gradient, whole tiles loaded at shifted positions
# (``_shifted``).


@triton.jit
def _load_x(x_cols, init_cols, pos, mask_d, seqlen, s_x_l, s_i_k, HAS_INIT: tl.constexpr, WIDTH: tl.constexpr):
    """x at positions ``pos`` ([BLOCK_L]; negative: the initial states, zeros without them) as fp32
    [BLOCK_D, BLOCK_L]; 0 past seqlen."""
    pos64 = pos.to(tl.int64)
    v = tl.load(x_cols + pos64[None, :] * s_x_l, mask=mask_d[:, None] & ((pos >= 0) & (pos < seqlen))[None, :],
                other=0.0).to(tl.float32)
    if HAS_INIT:
        before = (pos < 0) & (pos >= 1 - WIDTH)
        v += tl.load(init_cols + (pos64 + WIDTH - 1)[None, :] * s_i_k, mask=mask_d[:, None] & before[None, :],
                     other=0.0).to(tl.float32)
    return v


@triton.jit
def _load_sid(sid_row, pos, seqlen, s_si_l, HAS_SEQ_IDX: tl.constexpr):
    """Sequence ids of positions ``pos`` as [1, BLOCK_L] int64 (positions < 0 continue position 0's
    sequence; past seqlen the last one's); unused zeros without seq_idx."""
    if HAS_SEQ_IDX:
        clamped = tl.minimum(tl.maximum(pos, 0), seqlen - 1).to(tl.int64)
        sid = tl.load(sid_row + clamped * s_si_l).to(tl.int64)[None, :]
    else:
        sid = tl.zeros([1, pos.shape[0]], dtype=tl.int64)
    return sid


@triton.jit
def _load_taps(w_ptr, d64, mask_d, s_w_d, s_w_k, WIDTH: tl.constexpr):
    """The weights as a tuple of WIDTH [BLOCK_D, 1] fp32 columns."""
    taps = ()
    for k in tl.static_range(WIDTH):
        taps = taps + (tl.load(w_ptr + d64 * s_w_d + k * s_w_k, mask=mask_d, other=0.0).to(tl.float32)[:, None],)
    return taps


@triton.jit
def _shifted(x_cols, init_cols, sid_row, pos, mask_d, seqlen, s_x_l, s_i_k, s_si_l, LO: tl.constexpr,
             COUNT: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, WIDTH: tl.constexpr):
    """(x, sid) tuples of the tiles at pos + LO + r, r = 0 .. COUNT - 1."""
    xs = ()
    sids = ()
    for r in tl.static_range(COUNT):
        xs = xs + (_load_x(x_cols, init_cols, pos + (LO + r), mask_d, seqlen, s_x_l, s_i_k, HAS_INIT, WIDTH),)
        sids = sids + (_load_sid(sid_row, pos + (LO + r), seqlen, s_si_l, HAS_SEQ_IDX),)
    return xs, sids


@triton.jit
def _sigmoid(v):
    """1 / (1 + exp(-v)) with a fast (2-ulp) divide, which gives 0 where exp(-v) overflows; the
    forward and backward are memory-bound only while their per-position instruction count is small."""
    return tl.fdiv(1.0, 1.0 + tl.exp(-v), ieee_rounding=False)


@triton.jit
def _preact(xs, sids, taps, bias, AT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, WIDTH: tl.constexpr):
    """bias + sum_k w[k] x[t - (w-1) + k] at the positions of tile xs[AT] (xs[AT - s] is shifted by
    -s); inputs of another sequence count as 0."""
    acc = bias + taps[WIDTH - 1] * xs[AT]
    for k in tl.static_range(WIDTH - 1):
        v = xs[AT - (WIDTH - 1) + k]
        if HAS_SEQ_IDX:
            v = tl.where(sids[AT - (WIDTH - 1) + k] == sids[AT], v, 0.0)
        acc += taps[k] * v
    return acc


@triton.jit
def _conv_grads(x_cols, init_cols, sid_row, do_cols, pos, mask_d, seqlen, s_x_l, s_i_k, s_si_l, s_do_l, taps,
                bias, HAS_INIT: tl.constexpr, HAS_SEQ_IDX: tl.constexpr, SILU: tl.constexpr, WIDTH: tl.constexpr):
    """dx at the few positions ``pos`` (the initial states' gradient: positions -(w-1) .. -1), by shifted
    loads: dx[t] = sum_s w[w-1-s] dpre[t + s] (same sequence), dpre[t] = dout[t] act'(pre[t]) (0
    outside 0 <= t < seqlen), so the tiles at pos - (w-1) .. pos + w - 1 are loaded."""
    xs, sids = _shifted(x_cols, init_cols, sid_row, pos, mask_d, seqlen, s_x_l, s_i_k, s_si_l, 1 - WIDTH,
                        2 * WIDTH - 1, HAS_INIT, HAS_SEQ_IDX, WIDTH)
    dx = tl.zeros([mask_d.shape[0], pos.shape[0]], dtype=tl.float32)
    for s in tl.static_range(WIDTH):
        at = pos + s
        dpre = tl.load(do_cols + at.to(tl.int64)[None, :] * s_do_l,
                       mask=mask_d[:, None] & ((at >= 0) & (at < seqlen))[None, :], other=0.0).to(tl.float32)
        if SILU:
            pre = _preact(xs, sids, taps, bias, WIDTH - 1 + s, HAS_SEQ_IDX, WIDTH)
            sig = _sigmoid(pre)
            dpre = dpre * sig * (1.0 + pre * (1.0 - sig))
        if HAS_SEQ_IDX:  # padding outputs (id < 0) are constant 0
            dpre = tl.where((sids[WIDTH - 1 + s] == sids[WIDTH - 1]) & (sids[WIDTH - 1 + s] >= 0), dpre, 0.0)
        dx += taps[WIDTH - 1 - s] * dpre
    return dx


@triton.jit
def _unpack(t, LOG2_CHUNK: tl.constexpr):
    """t [a, n, 2**LOG2_CHUNK] -> tuple of its 2**LOG2_CHUNK slices [a, n, 1] along the last axis, in
    order. The chunk axis lies in one thread, so these are register renames (halving splits)."""
    parts = (t,)
    for level in tl.static_range(LOG2_CHUNK):
        halves = ()
        for i in tl.static_range(1 << level):
            p = parts[i]
            p = tl.permute(tl.reshape(p, [p.shape[0], p.shape[1], 2, p.shape[2] // 2]), (0, 1, 3, 2))
            lo, hi = tl.split(p)
            halves = halves + (lo, hi)
        parts = halves
    return parts


@triton.jit
def _pack(parts, LOG2_CHUNK: tl.constexpr):
    """The inverse of ``_unpack``: a tuple of 2**LOG2_CHUNK [a, n, 1] -> [a, n, 2**LOG2_CHUNK]."""
    for level in tl.static_range(LOG2_CHUNK):
        pairs = ()
        for i in tl.static_range(1 << (LOG2_CHUNK - 1 - level)):
            p = tl.permute(tl.join(parts[2 * i], parts[2 * i + 1]), (0, 1, 3, 2))
            pairs = pairs + (tl.reshape(p, [p.shape[0], p.shape[1], 2 * p.shape[3]]),)
        parts = pairs
    return parts[0]


@triton.jit
def _load_chunks(cols, init_cols, pos, mask_d, seqlen, s_l, s_i_k, HAS_INIT: tl.constexpr, WIDTH: tl.constexpr,
                 LOG2_CHUNK: tl.constexpr):
    """cols at ``pos`` [1, n, CHUNK] (mask_d [BLOCK_D, 1, 1]) as fp32, unpacked into CHUNK [BLOCK_D, n, 1]
    tiles; negative positions read the initial states (zeros without them), 0 past seqlen."""
    v = tl.load(cols + pos.to(tl.int64) * s_l, mask=mask_d & (pos >= 0) & (pos < seqlen), other=0.0).to(tl.float32)
    if HAS_INIT:
        v += tl.load(init_cols + (pos + WIDTH - 1).to(tl.int64) * s_i_k,
                     mask=mask_d & (pos < 0) & (pos >= 1 - WIDTH), other=0.0).to(tl.float32)
    return _unpack(v, LOG2_CHUNK)


@triton.jit
def _load_sid_chunks(sid_row, pos, seqlen, s_si_l, LOG2_CHUNK: tl.constexpr):
    """Sequence ids at ``pos`` [1, n, CHUNK] (clamped as in ``_load_sid``), unpacked into [1, n, 1] tiles."""
    clamped = tl.minimum(tl.maximum(pos, 0), seqlen - 1).to(tl.int64)
    return _unpack(tl.load(sid_row + clamped * s_si_l).to(tl.int64), LOG2_CHUNK)


@triton.jit
def _causal_conv1d_fwd_kernel(x_ptr, w_ptr, bias_ptr, seq_idx_ptr, init_ptr, out_ptr,
                              dim, seqlen, s_x_b, s_x_d, s_x_l, s_w_d, s_w_k, s_si_b, s_si_l,
                              s_i_b, s_i_d, s_i_k, s_o_b, s_o_d, s_o_l,
                              WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                              HAS_INIT: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_L: tl.constexpr, LOG2_CHUNK: tl.constexpr):
    # A program owns [BLOCK_D, BLOCK_L] as BLOCK_L / CHUNK chunks of CHUNK consecutive positions, each
    # chunk in one thread (channel-first: CHUNK = 16 bytes, one vector load; channel-last: CHUNK 1
    # and the tile is contiguous along dim). The w-1 inputs before a chunk are the tail of the HALO
    # chunks before it: HALO more loads of the same aligned pattern, which hit L1/L2, so x is read
    # from DRAM once and every access stays vectorised (shifted loads by 1..w-1 positions would not be).
    CHUNK: tl.constexpr = 1 << LOG2_CHUNK
    HALO: tl.constexpr = (WIDTH - 1 + CHUNK - 1) // CHUNK
    b64 = tl.program_id(2).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    taps = _load_taps(w_ptr, d64, mask_d, s_w_d, s_w_k, WIDTH)
    taps3 = ()
    for k in tl.static_range(WIDTH):
        taps3 = taps3 + (taps[k][:, :, None],)
    bias3 = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)[:, None, None] if HAS_BIAS else 0.0
    # 3-D tiles [BLOCK_D, chunks, CHUNK]
    d3 = d64[:, None, None]
    mask_d3 = mask_d[:, None, None]
    pos = tl.program_id(0) * BLOCK_L + (tl.arange(0, BLOCK_L // CHUNK)[:, None] * CHUNK
                                        + tl.arange(0, CHUNK)[None, :])[None, :, :]
    x_cols = x_ptr + b64 * s_x_b + d3 * s_x_d
    init_cols = init_ptr + b64 * s_i_b + d3 * s_i_d
    sid_row = seq_idx_ptr + b64 * s_si_b
    # xs[HALO * CHUNK + q]: x at chunk offset q = -HALO * CHUNK .. CHUNK - 1
    xs = ()
    sids = ()
    for h in tl.static_range(HALO + 1):
        at = pos + (h - HALO) * CHUNK
        xs = xs + _load_chunks(x_cols, init_cols, at, mask_d3, seqlen, s_x_l, s_i_k, HAS_INIT, WIDTH, LOG2_CHUNK)
        if HAS_SEQ_IDX:
            sids = sids + _load_sid_chunks(sid_row, at, seqlen, s_si_l, LOG2_CHUNK)
    if not HAS_SEQ_IDX:
        sids = xs  # unused
    outs = ()
    for j in tl.static_range(CHUNK):
        pre = _preact(xs, sids, taps3, bias3, HALO * CHUNK + j, HAS_SEQ_IDX, WIDTH)
        if SILU:
            pre = pre * _sigmoid(pre)
        if HAS_SEQ_IDX:  # padding positions (id < 0) output 0
            pre = tl.where(sids[HALO * CHUNK + j] >= 0, pre, 0.0)
        outs = outs + (pre,)
    tl.store(out_ptr + b64 * s_o_b + d3 * s_o_d + pos.to(tl.int64) * s_o_l,
             _pack(outs, LOG2_CHUNK).to(out_ptr.dtype.element_ty), mask=mask_d3 & (pos < seqlen))


@triton.jit
def _causal_conv1d_bwd_kernel(x_ptr, w_ptr, bias_ptr, seq_idx_ptr, init_ptr, dout_ptr, dx_ptr, dw_ptr, dbias_ptr,
                              dinit_ptr, dim, seqlen, s_x_b, s_x_d, s_x_l, s_w_d, s_w_k, s_si_b, s_si_l,
                              s_i_b, s_i_d, s_i_k, s_do_b, s_do_d, s_do_l, s_dx_b, s_dx_d, s_dx_l,
                              s_di_b, s_di_d, s_di_k,
                              WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                              HAS_INIT: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
                              BLOCK_L: tl.constexpr, BLOCK_W: tl.constexpr, LOG2_CHUNK: tl.constexpr,
                              DETERMINISTIC: tl.constexpr = False):
    # A program owns BLOCK_L positions as BLOCK_L / CHUNK chunks of CHUNK consecutive positions, each
    # chunk in one thread: the shifted inputs a position needs are that thread's registers (the chunks
    # before/after supply the w-1 halo: two extra loads that hit L1), so each pre-activation and its
    # silu' is computed once (CHUNK + w - 1 a chunk), and dweight/dbias are summed in registers and
    # reduced across threads once a program (then one fp32 atomic per dim and tap).
    CHUNK: tl.constexpr = 1 << LOG2_CHUNK
    pid_s = tl.program_id(0)
    b64 = tl.program_id(2).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    sid_row = seq_idx_ptr + b64 * s_si_b
    taps = _load_taps(w_ptr, d64, mask_d, s_w_d, s_w_k, WIDTH)
    bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)[:, None] if HAS_BIAS else 0.0
    if HAS_INIT:  # the first program also owns the initial states: positions -(w-1) .. -1
        if pid_s == 0:
            ks = tl.arange(0, BLOCK_W)
            dinit = _conv_grads(x_ptr + b64 * s_x_b + d64[:, None] * s_x_d,
                                init_ptr + b64 * s_i_b + d64[:, None] * s_i_d, sid_row,
                                dout_ptr + b64 * s_do_b + d64[:, None] * s_do_d, ks - (WIDTH - 1), mask_d, seqlen,
                                s_x_l, s_i_k, s_si_l, s_do_l, taps, bias, HAS_INIT, HAS_SEQ_IDX, SILU, WIDTH)
            tl.store(dinit_ptr + b64 * s_di_b + d64[:, None] * s_di_d + ks.to(tl.int64)[None, :] * s_di_k,
                     dinit.to(dinit_ptr.dtype.element_ty), mask=mask_d[:, None] & (ks < WIDTH - 1)[None, :])

    # 3-D tiles [BLOCK_D, chunks, CHUNK]
    d3 = d64[:, None, None]
    mask_d3 = mask_d[:, None, None]
    taps3 = ()
    for k in tl.static_range(WIDTH):
        taps3 = taps3 + (taps[k][:, :, None],)
    bias3 = bias[:, :, None] if HAS_BIAS else 0.0
    pos = pid_s * BLOCK_L + (tl.arange(0, BLOCK_L // CHUNK)[:, None] * CHUNK + tl.arange(0, CHUNK)[None, :])[None, :, :]
    x_cols = x_ptr + b64 * s_x_b + d3 * s_x_d
    init_cols = init_ptr + b64 * s_i_b + d3 * s_i_d
    do_cols = dout_ptr + b64 * s_do_b + d3 * s_do_d
    # xs[CHUNK + q]: x at chunk offset q = -CHUNK .. 2 CHUNK - 1; douts[j]: dout at j = 0 .. 2 CHUNK - 1
    xs = (_load_chunks(x_cols, init_cols, pos - CHUNK, mask_d3, seqlen, s_x_l, s_i_k, HAS_INIT, WIDTH, LOG2_CHUNK)
          + _load_chunks(x_cols, init_cols, pos, mask_d3, seqlen, s_x_l, s_i_k, HAS_INIT, WIDTH, LOG2_CHUNK)
          + _load_chunks(x_cols, init_cols, pos + CHUNK, mask_d3, seqlen, s_x_l, s_i_k, HAS_INIT, WIDTH, LOG2_CHUNK))
    douts = (_load_chunks(do_cols, do_cols, pos, mask_d3, seqlen, s_do_l, 0, False, WIDTH, LOG2_CHUNK)
             + _load_chunks(do_cols, do_cols, pos + CHUNK, mask_d3, seqlen, s_do_l, 0, False, WIDTH, LOG2_CHUNK))
    if HAS_SEQ_IDX:
        sids = (_load_sid_chunks(sid_row, pos - CHUNK, seqlen, s_si_l, LOG2_CHUNK)
                + _load_sid_chunks(sid_row, pos, seqlen, s_si_l, LOG2_CHUNK)
                + _load_sid_chunks(sid_row, pos + CHUNK, seqlen, s_si_l, LOG2_CHUNK))
    else:
        sids = xs  # unused

    # dpre[j] = dout act'(pre) at chunk offsets j = 0 .. CHUNK + w - 2 (dout is 0 past seqlen)
    dpres = ()
    for j in tl.static_range(CHUNK + WIDTH - 1):
        g = douts[j]
        if SILU:
            pre = _preact(xs, sids, taps3, bias3, CHUNK + j, HAS_SEQ_IDX, WIDTH)
            sig = _sigmoid(pre)
            g = g * sig * (1.0 + pre * (1.0 - sig))
        if HAS_SEQ_IDX:  # padding outputs (id < 0) are constant 0
            g = tl.where(sids[CHUNK + j] >= 0, g, 0.0)
        dpres = dpres + (g,)

    # dx[t] = sum_s w[w-1-s] dpre[t+s];  dweight[k] += dpre[t] x[t-(w-1)+k];  dbias += dpre[t] (same sequence)
    dxs = ()
    dws = ()
    for k in tl.static_range(WIDTH):
        dws = dws + (tl.zeros([BLOCK_D, BLOCK_L // CHUNK, 1], dtype=tl.float32),)
    dbias = tl.zeros([BLOCK_D, BLOCK_L // CHUNK, 1], dtype=tl.float32)
    for j in tl.static_range(CHUNK):
        dx = taps3[WIDTH - 1] * dpres[j]
        for s in tl.static_range(1, WIDTH):
            g = dpres[j + s]
            if HAS_SEQ_IDX:
                g = tl.where(sids[CHUNK + j + s] == sids[CHUNK + j], g, 0.0)
            dx += taps3[WIDTH - 1 - s] * g
        dxs = dxs + (dx,)
        new_dws = ()
        for k in tl.static_range(WIDTH):
            v = xs[CHUNK + j - (WIDTH - 1) + k]
            if HAS_SEQ_IDX:
                v = tl.where(sids[CHUNK + j - (WIDTH - 1) + k] == sids[CHUNK + j], v, 0.0)
            new_dws = new_dws + (dws[k] + dpres[j] * v,)
        dws = new_dws
        dbias += dpres[j]
    dx_cols = dx_ptr + b64 * s_dx_b + d3 * s_dx_d
    tl.store(dx_cols + pos.to(tl.int64) * s_dx_l, _pack(dxs, LOG2_CHUNK).to(dx_ptr.dtype.element_ty),
             mask=mask_d3 & (pos < seqlen))
    if DETERMINISTIC:  # dw_ptr is the workspace [parts, dim, w + 1]: this program's sums go to its own
        # part (column w: dbias), summed in part order by _sum_partials_kernel
        part_row = dw_ptr + ((b64 * tl.num_programs(0) + pid_s) * dim + d64) * (WIDTH + 1)
        for k in tl.static_range(WIDTH):
            tl.store(part_row + k, tl.sum(tl.sum(dws[k], axis=2), axis=1), mask=mask_d)
        if HAS_BIAS:
            tl.store(part_row + WIDTH, tl.sum(tl.sum(dbias, axis=2), axis=1), mask=mask_d)
    else:
        for k in tl.static_range(WIDTH):
            tl.atomic_add(dw_ptr + d64 * WIDTH + k, tl.sum(tl.sum(dws[k], axis=2), axis=1), mask=mask_d,
                          sem="relaxed")
        if HAS_BIAS:
            tl.atomic_add(dbias_ptr + d, tl.sum(tl.sum(dbias, axis=2), axis=1), mask=mask_d, sem="relaxed")


@triton.jit
def _sum_partials_kernel(part_ptr, dw_ptr, dbias_ptr, parts, dim, WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr,
                         BLOCK: tl.constexpr):
    # dweight [d, w] (and dbias [d]) += the sum over parts of the workspace [parts, d, w + 1], always in
    # part order, so the result does not depend on which program finished first
    e = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # element (d, k) of [dim, w + 1]
    live = e < dim * (WIDTH + 1)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    part = part_ptr + e  # pointers advance in 64 bits: parts * dim * (w + 1) may pass 2^31
    for _ in range(parts):
        acc += tl.load(part, mask=live, other=0.0)
        part += dim * (WIDTH + 1)
    d = e // (WIDTH + 1)
    k = e % (WIDTH + 1)
    w_at = dw_ptr + d * WIDTH + k
    tl.store(w_at, tl.load(w_at, mask=live & (k < WIDTH), other=0.0) + acc, mask=live & (k < WIDTH))
    if HAS_BIAS:
        b_at = dbias_ptr + d
        tl.store(b_at, tl.load(b_at, mask=live & (k == WIDTH), other=0.0) + acc, mask=live & (k == WIDTH))


@triton.jit
def _causal_conv1d_update_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, cache_seqlens_ptr, out_ptr,
                                 dim, steps, state_len, s_x_b, s_x_d, s_x_l, s_st_b, s_st_d, s_st_l,
                                 s_w_d, s_w_k, s_o_b, s_o_d, s_o_l,
                                 WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                                 CIRCULAR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                                 BLOCK_STATE: tl.constexpr, state_indices_ptr=None,
                                 HAS_STATE_INDICES: tl.constexpr = False):
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    i = tl.arange(0, BLOCK_S)  # new tokens
    x_rows = x_ptr + b64 * s_x_b + d64[:, None] * s_x_d
    if HAS_STATE_INDICES:  # row b's state is conv_state[conv_state_indices[b]]; a negative index is a
        # padding slot: its state is neither read nor written and its output is 0 (causal-conv1d's rule)
        slot_b = tl.load(state_indices_ptr + b).to(tl.int64)
        st_rows = state_ptr + tl.maximum(slot_b, 0) * s_st_b + d64[:, None] * s_st_d
        mask_st = mask_d & (slot_b >= 0)
    else:
        st_rows = state_ptr + b64 * s_st_b + d64[:, None] * s_st_d
        mask_st = mask_d
    if CIRCULAR:
        start = tl.load(cache_seqlens_ptr + b).to(tl.int32)  # where token 0 goes in the ring

    # inputs at positions q = i - (w-1) + k relative to the first new token; q < 0 is the state
    acc = tl.zeros([BLOCK_D, BLOCK_S], dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)[:, None]
    for k in tl.static_range(WIDTH):
        q = i - (WIDTH - 1) + k
        live = (i < steps)[None, :] & mask_d[:, None]
        v = tl.load(x_rows + tl.maximum(q, 0).to(tl.int64)[None, :] * s_x_l, mask=live & (q >= 0)[None, :], other=0.0)
        if CIRCULAR:
            slot = (start + q) % state_len
            slot = tl.where(slot < 0, slot + state_len, slot)
        else:
            slot = state_len + q
        v2 = tl.load(st_rows + slot.to(tl.int64)[None, :] * s_st_l, mask=live & mask_st[:, None] & (q < 0)[None, :],
                     other=0.0)
        w_k = tl.load(w_ptr + d64 * s_w_d + k * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
        acc += w_k[:, None] * (v.to(tl.float32) + v2.to(tl.float32))
    if SILU:
        acc = acc * tl.sigmoid(acc)
    if HAS_STATE_INDICES:
        acc = tl.where(mask_st[:, None], acc, 0.0)
    tl.store(out_ptr + b64 * s_o_b + d64[:, None] * s_o_d + i.to(tl.int64)[None, :] * s_o_l,
             acc.to(out_ptr.dtype.element_ty), mask=mask_d[:, None] & (i < steps)[None, :])

    # the new state, read in full before any thread writes it
    j = tl.arange(0, BLOCK_STATE)
    if CIRCULAR:  # the last min(steps, state_len) tokens go to their ring slots
        kept = (i >= steps - state_len) & (i < steps)
        xv = tl.load(x_rows + i.to(tl.int64)[None, :] * s_x_l, mask=mask_d[:, None] & kept[None, :], other=0.0)
        tl.debug_barrier()
        slot = (start + i) % state_len
        tl.store(st_rows + slot.to(tl.int64)[None, :] * s_st_l, xv.to(state_ptr.dtype.element_ty),
                 mask=mask_st[:, None] & kept[None, :])
    else:  # new_state[j] = concat(state, x)[j + steps]
        src = j + steps
        from_state = src < state_len
        keep = tl.load(st_rows + tl.minimum(src, state_len - 1).to(tl.int64)[None, :] * s_st_l,
                       mask=mask_st[:, None] & (from_state & (j < state_len))[None, :], other=0.0)
        new = tl.load(x_rows + tl.maximum(src - state_len, 0).to(tl.int64)[None, :] * s_x_l,
                      mask=mask_d[:, None] & (~from_state & (j < state_len))[None, :], other=0.0)
        tl.debug_barrier()
        tl.store(st_rows + j.to(tl.int64)[None, :] * s_st_l,
                 tl.where(from_state[None, :], keep.to(state_ptr.dtype.element_ty), new.to(state_ptr.dtype.element_ty)),
                 mask=mask_st[:, None] & (j < state_len)[None, :])


# ----------------------------------------------------------------------------------------------
# launchers

def _or(t, stand_in):
    """An absent optional tensor as the kernel takes it: a stand-in pointer that its constexpr flag
    keeps from being read (the kernels form row pointers before branching on the flags)."""
    return stand_in if t is None else t


def check_activation(activation):
    """True for silu; ValueError naming the argument for anything but None/'silu'/'swish'."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    return ACTIVATIONS[activation]


def tiles(x, dim: int, seqlen: int, width: int, backward: bool, block_d=None, block_l=None, segment=None,
          num_warps=None, chunk=None):
    """(BLOCK_D, BLOCK_L, BLOCK_W, CHUNK, num_warps); a program is one [BLOCK_D, BLOCK_L] tile, ``segment``
    caps BLOCK_L. Channel-first x (seqlen contiguous): one row's run of positions a tile (2048 in the
    forward, 1024 in the backward; more dims when the rows are shorter) and 16 positions a thread, as
    CHUNK-long runs (16 bytes of x; the backward also at least w - 1). Otherwise (dim contiguous or
    any strides) the transpose, CHUNK 1 in the forward. CHUNK divides BLOCK_L. These won an H200
    sweep at the benchmark shape (benchmarks/NOTES.md)."""
    seq_major = T.strides(x)[2] == 1 or seqlen == 1
    if chunk is None:
        vector = 16 // T.itemsize(x) if seq_major or backward else 1
        chunk = max(vector, triton.next_power_of_2(max(width - 1, 1))) if backward else vector
    if seq_major:
        run = 1024 if backward else 2048
        block_l = block_l or min(run, triton.next_power_of_2(seqlen))
        block_d = block_d or min(triton.next_power_of_2(dim),
                                 max(1, run // block_l, triton.next_power_of_2(triton.cdiv(dim, 65535))))
        per_thread = 16
    else:
        block_d = block_d or min(64 if backward else 128, triton.next_power_of_2(dim))
        block_l = block_l or min(32 if backward else 16, triton.next_power_of_2(seqlen))
        per_thread = 8
    if segment is not None:
        block_l = min(block_l, segment)
    block_l = max(block_l, chunk)
    if triton.cdiv(dim, block_d) > 65535:  # the grid's second axis
        raise ValueError(f"block_d: {block_d} leaves more than 65535 tiles along dim {dim}")
    for name, value in (("block_d", block_d), ("block_l", block_l), ("chunk", chunk)):
        if value < 1 or value & (value - 1):
            raise ValueError(f"{name}: expected a power of two, got {value}")
    if backward and chunk < width - 1:
        raise ValueError(f"chunk: the backward needs at least width - 1 = {width - 1} positions a thread, got {chunk}")
    warps = num_warps or max(1, min(4, block_d * block_l // (32 * per_thread)))
    return block_d, block_l, triton.next_power_of_2(width), chunk, warps


def conv_args(x, weight, bias, seq_idx, initial_states):
    """Shapes checked; (batch, dim, seqlen, width, seq_idx strides, initial_states strides)."""
    if len(T.shape(x)) != 3:
        raise ValueError(f"x: expected [batch, dim, seqlen], got shape {T.shape(x)}")
    batch, dim, seqlen = T.shape(x)
    if len(T.shape(weight)) != 2 or T.shape(weight)[0] != dim or T.shape(weight)[1] < 1:
        raise ValueError(f"weight: expected [dim={dim}, width >= 1], got shape {T.shape(weight)}")
    width = T.shape(weight)[1]
    if bias is not None:
        T.check_same_shape("bias", bias, (dim,))
    si_st = (0, 0)
    if seq_idx is not None:
        T.check_same_shape("seq_idx", seq_idx, (batch, seqlen))
        if T.dtype_name(seq_idx) not in ("int32", "int64"):
            raise TypeError(f"seq_idx: expected int32 or int64, got {T.dtype_name(seq_idx)}")
        si_st = T.strides(seq_idx)
    init_st = (0, 0, 0)
    if initial_states is not None:
        if width < 2:
            raise ValueError("initial_states: a width-1 conv has no state")
        T.check_same_shape("initial_states", initial_states, (batch, dim, width - 1))
        init_st = T.strides(initial_states)
    return batch, dim, seqlen, width, si_st, init_st


def causal_conv1d_fwd(x, weight, out, bias=None, seq_idx=None, initial_states=None, activation=None,
                      block_d=None, block_l=None, segment=None, num_warps=None, chunk=None) -> None:
    """out[b, d, l] = act(causal depthwise conv of x), written in place. ``block_d``/``block_l``/
    ``num_warps``/``chunk`` override the tile (``segment``: at most that many positions a tile)."""
    silu = check_activation(activation)
    batch, dim, seqlen, width, si_st, init_st = conv_args(x, weight, bias, seq_idx, initial_states)
    T.check_same_shape("out", out, (batch, dim, seqlen))
    if batch * dim * seqlen == 0:
        return
    block_d, block_l, _, chunk, warps = tiles(x, dim, seqlen, width, False, block_d, block_l, segment, num_warps,
                                              chunk)
    grid = (triton.cdiv(seqlen, block_l), triton.cdiv(dim, block_d), batch)
    _causal_conv1d_fwd_kernel[grid](x, weight, _or(bias, x), _or(seq_idx, x), _or(initial_states, x), out, dim,
                                    seqlen, *T.strides(x), *T.strides(weight), *si_st, *init_st, *T.strides(out),
                                    WIDTH=width, HAS_BIAS=bias is not None, HAS_SEQ_IDX=seq_idx is not None,
                                    HAS_INIT=initial_states is not None, SILU=silu, BLOCK_D=block_d, BLOCK_L=block_l,
                                    LOG2_CHUNK=chunk.bit_length() - 1, num_warps=warps)


def check_grad_buffers(dout, dx, dweight, bias, dbias, batch, dim, seqlen, width) -> None:
    """dout, dx [b, d, l]; dweight [d, w] and dbias [d] (exactly when bias is given) float32
    contiguous accumulators. Shared with the CUDA wrapper."""
    T.check_same_shape("dout", dout, (batch, dim, seqlen))
    T.check_same_shape("dx", dx, (batch, dim, seqlen))
    for name, t, shape in (("dweight", dweight, (dim, width)), ("dbias", dbias, (dim,))):
        if t is not None:
            T.check_same_shape(name, t, shape)
            T.check_contiguous(name, t)
            if T.dtype_name(t) != "float32":
                raise TypeError(f"{name}: expected a float32 accumulator, got {T.dtype_name(t)}")
    if (bias is None) != (dbias is None):
        raise ValueError("dbias: expected exactly when bias is given")


def bwd_workspace_shape(x, weight, block_d=None, block_l=None, segment=None, num_warps=None, chunk=None):
    """The float32 workspace ``causal_conv1d_bwd(..., workspace=)`` takes for a deterministic
    backward: one [dim, width + 1] row of partial sums per program along (batch, seqlen)."""
    batch, dim, seqlen = T.shape(x)
    width = T.shape(weight)[1]
    block_l = tiles(x, dim, seqlen, width, True, block_d, block_l, segment, num_warps, chunk)[1]
    return (batch * triton.cdiv(seqlen, block_l), dim, width + 1)


def causal_conv1d_bwd(x, weight, dout, dx, dweight, bias=None, dbias=None, seq_idx=None, initial_states=None,
                      dinitial_states=None, activation=None, block_d=None, block_l=None, segment=None,
                      num_warps=None, chunk=None, workspace=None) -> None:
    """Gradients of the conv. Written in place: dx [b, d, l] and dinitial_states [b, d, w-1] (when
    initial_states is given). Accumulated (+=, float32 contiguous, the caller zeroes them):
    dweight [d, w] and dbias [d] (when bias is given). ``block_d``/``block_l``/``num_warps``/``chunk``
    override the tile (``segment``: at most that many positions a program). ``workspace`` (float32
    contiguous, ``bwd_workspace_shape``; contents ignored) makes the weight reductions deterministic:
    per-program partial sums there, then summed in a fixed order, instead of fp32 atomics."""
    silu = check_activation(activation)
    batch, dim, seqlen, width, si_st, init_st = conv_args(x, weight, bias, seq_idx, initial_states)
    check_grad_buffers(dout, dx, dweight, bias, dbias, batch, dim, seqlen, width)
    if workspace is not None:
        T.check_same_shape("workspace", workspace, bwd_workspace_shape(x, weight, block_d, block_l, segment,
                                                                       num_warps, chunk))
        T.check_contiguous("workspace", workspace)
        if T.dtype_name(workspace) != "float32":
            raise TypeError(f"workspace: expected float32, got {T.dtype_name(workspace)}")
    if (initial_states is None) != (dinitial_states is None):
        raise ValueError("dinitial_states: expected exactly when initial_states is given")
    di_st = (0, 0, 0)
    if dinitial_states is not None:
        T.check_same_shape("dinitial_states", dinitial_states, (batch, dim, width - 1))
        di_st = T.strides(dinitial_states)
    if batch * dim * seqlen == 0:
        return
    block_d, block_l, block_w, chunk, warps = tiles(x, dim, seqlen, width, True, block_d, block_l, segment,
                                                    num_warps, chunk)
    grid = (triton.cdiv(seqlen, block_l), triton.cdiv(dim, block_d), batch)
    flags = {} if workspace is None else {"DETERMINISTIC": True}  # the default build stays as it was
    _causal_conv1d_bwd_kernel[grid](x, weight, _or(bias, x), _or(seq_idx, x), _or(initial_states, x), dout, dx,
                                    _or(workspace, dweight), _or(dbias, x), _or(dinitial_states, x), dim, seqlen,
                                    *T.strides(x), *T.strides(weight), *si_st, *init_st, *T.strides(dout),
                                    *T.strides(dx), *di_st,
                                    WIDTH=width, HAS_BIAS=bias is not None, HAS_SEQ_IDX=seq_idx is not None,
                                    HAS_INIT=initial_states is not None, SILU=silu, BLOCK_D=block_d, BLOCK_L=block_l,
                                    BLOCK_W=block_w, LOG2_CHUNK=chunk.bit_length() - 1, num_warps=warps, **flags)
    if workspace is not None:
        block = min(1024, triton.next_power_of_2(dim * (width + 1)))
        _sum_partials_kernel[(triton.cdiv(dim * (width + 1), block),)](
            workspace, dweight, _or(dbias, dweight), T.shape(workspace)[0], dim, WIDTH=width,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)


def update_args(x, conv_state, weight, out, bias, cache_seqlens, conv_state_indices=None):
    """Shapes checked; (batch, dim, steps, width, state_len, x strides, out strides), the strides of a
    2-D x / out padded with a 0 for the steps axis. With ``conv_state_indices`` [batch] (int32/int64)
    conv_state may hold any number of slots."""
    x_dims = T.shape(x)
    if len(x_dims) not in (2, 3):
        raise ValueError(f"x: expected [batch, dim] or [batch, dim, seqlen], got shape {x_dims}")
    batch, dim = x_dims[:2]
    steps = x_dims[2] if len(x_dims) == 3 else 1
    x_st = T.strides(x) if len(x_dims) == 3 else (*T.strides(x), 0)
    T.check_same_shape("out", out, x_dims)
    o_st = T.strides(out) if len(x_dims) == 3 else (*T.strides(out), 0)
    if len(T.shape(weight)) != 2 or T.shape(weight)[0] != dim:
        raise ValueError(f"weight: expected [dim={dim}, width], got shape {T.shape(weight)}")
    width = T.shape(weight)[1]
    st_dims = T.shape(conv_state)
    slots = batch if conv_state_indices is None else st_dims[0] if st_dims else None
    if len(st_dims) != 3 or st_dims[:2] != (slots, dim) or st_dims[2] < width - 1:
        raise ValueError(f"conv_state: expected [batch={batch}, dim={dim}, state_len >= width - 1 = {width - 1}], "
                         f"got shape {st_dims}")
    if bias is not None:
        T.check_same_shape("bias", bias, (dim,))
    if cache_seqlens is not None:
        T.check_same_shape("cache_seqlens", cache_seqlens, (batch,))
        if T.dtype_name(cache_seqlens) not in ("int32", "int64"):
            raise TypeError(f"cache_seqlens: expected int32 or int64, got {T.dtype_name(cache_seqlens)}")
    if conv_state_indices is not None:
        T.check_same_shape("conv_state_indices", conv_state_indices, (batch,))
        if T.dtype_name(conv_state_indices) not in ("int32", "int64"):
            raise TypeError(f"conv_state_indices: expected int32 or int64, got {T.dtype_name(conv_state_indices)}")
    return batch, dim, steps, width, st_dims[2], x_st, o_st


def causal_conv1d_update(x, conv_state, weight, out, bias=None, activation=None, cache_seqlens=None,
                         conv_state_indices=None) -> None:
    """Decoding: out (x's shape, [b, d] or [b, d, s]) from the new tokens x and conv_state
    [b, d, state_len >= w - 1], which is updated in place (shifted, or a ring buffer indexed by
    ``cache_seqlens`` [b]). With ``conv_state_indices`` [b], conv_state is [slots, d, state_len] and row
    b uses slot ``conv_state_indices[b]`` (indices < slots, the caller's check); a negative index is a
    padding row: output 0, no state touched."""
    silu = check_activation(activation)
    batch, dim, steps, width, state_len, x_st, o_st = update_args(x, conv_state, weight, out, bias, cache_seqlens,
                                                                  conv_state_indices)
    if batch * dim == 0 or steps == 0:
        return
    block_s, block_state = triton.next_power_of_2(steps), triton.next_power_of_2(max(state_len, 1))
    block_d = max(1, min(triton.next_power_of_2(dim), 4096 // max(block_s, block_state)))
    _causal_conv1d_update_kernel[(triton.cdiv(dim, block_d), batch)](
        x, conv_state, weight, bias, cache_seqlens, out, dim, steps, state_len, *x_st, *T.strides(conv_state),
        *T.strides(weight), *o_st, WIDTH=width, HAS_BIAS=bias is not None, SILU=silu,
        CIRCULAR=cache_seqlens is not None, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_STATE=block_state,
        num_warps=4, **({} if conv_state_indices is None else
                        {"state_indices_ptr": conv_state_indices, "HAS_STATE_INDICES": True}))


@triton.jit
def _varlen_states_kernel(x_ptr, cu_ptr, states_ptr, dim, state_len, s_x_t, s_x_d, s_s_b, s_s_d, s_s_k,
                          BLOCK_D: tl.constexpr, BLOCK_K: tl.constexpr):
    # states[b, :, k] = x[end_b - state_len + k] for the tokens of sequence b, 0 before its start
    b = tl.program_id(1)
    start = tl.load(cu_ptr + b).to(tl.int64)
    end = tl.load(cu_ptr + b + 1).to(tl.int64)
    d = (tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)).to(tl.int64)
    k = tl.arange(0, BLOCK_K).to(tl.int64)
    for k0 in range(0, state_len, BLOCK_K):
        kk = k0 + k
        t = end - state_len + kk
        mask = (d < dim)[:, None] & (kk < state_len)[None, :]
        v = tl.load(x_ptr + t[None, :] * s_x_t + d[:, None] * s_x_d, mask=mask & (t >= start)[None, :], other=0.0)
        tl.store(states_ptr + b.to(tl.int64) * s_s_b + d[:, None] * s_s_d + kk[None, :] * s_s_k, v, mask=mask)


def causal_conv1d_varlen_states(x, cu_seqlens, states) -> None:
    """The last ``state_len`` inputs of each sequence of a packed batch: x [total_tokens, dim],
    cu_seqlens [batch + 1] (int32/int64, sorted, from 0, last <= total_tokens: the caller's check),
    states [batch, dim, state_len] written in x's dtype, zeros before a sequence's first token."""
    if len(T.shape(x)) != 2:
        raise ValueError(f"x: expected [total_tokens, dim], got shape {T.shape(x)}")
    dim = T.shape(x)[1]
    if len(T.shape(cu_seqlens)) != 1 or T.shape(cu_seqlens)[0] < 1:
        raise ValueError(f"cu_seqlens: expected [batch + 1], got shape {T.shape(cu_seqlens)}")
    if T.dtype_name(cu_seqlens) not in ("int32", "int64"):
        raise TypeError(f"cu_seqlens: expected int32 or int64, got {T.dtype_name(cu_seqlens)}")
    T.check_contiguous("cu_seqlens", cu_seqlens)
    batch = T.shape(cu_seqlens)[0] - 1
    st_dims = T.shape(states)
    if len(st_dims) != 3 or st_dims[:2] != (batch, dim):
        raise ValueError(f"states: expected [batch={batch}, dim={dim}, state_len], got shape {st_dims}")
    if T.dtype_name(states) != T.dtype_name(x):
        raise TypeError(f"states: expected x's dtype {T.dtype_name(x)}, got {T.dtype_name(states)}")
    state_len = st_dims[2]
    if batch * dim * state_len == 0:
        return
    block_k = min(16, triton.next_power_of_2(state_len))
    block_d = min(256, triton.next_power_of_2(dim))
    _varlen_states_kernel[(triton.cdiv(dim, block_d), batch)](
        x, cu_seqlens, states, dim, state_len, *T.strides(x), *T.strides(states), BLOCK_D=block_d, BLOCK_K=block_k,
        num_warps=4)


def compile_cases():
    """The canonical case (width 4, bias, silu; channel-first) in each dtype; channel-last, seq_idx
    with initial states, and width 2 without bias or activation in one dtype; the decoding update."""
    S = T.SpecTensor
    batch, dim, seqlen = 8, 4096, 2048
    last = (dim * seqlen, 1, dim)
    cases = [(dtype, None, False) for dtype in T.FLOAT_DTYPES] + [("bfloat16", last, False), ("bfloat16", last, True)]
    for dtype, stride, packed in cases:
        x, out, dout, dx = (S((batch, dim, seqlen), dtype, stride) for _ in range(4))
        w, bias = S((dim, 4), dtype), S((dim,), dtype)
        dw, db = S((dim, 4), "float32"), S((dim,), "float32")
        seq_idx = S((batch, seqlen), "int32") if packed else None
        init = S((batch, dim, 3), dtype) if packed else None
        name = f"{dtype},{'last' if stride else 'first'}{',seq_idx,init' if packed else ''}"
        yield f"causal_conv1d_fwd[{name}]", \
            lambda a=(x, w, out, bias, seq_idx, init): causal_conv1d_fwd(*a, activation="silu")
        yield f"causal_conv1d_bwd[{name}]", lambda a=(x, w, dout, dx, dw, bias, db, seq_idx, init, init): \
            causal_conv1d_bwd(*a, activation="silu")
    x2, w2, dw2 = S((batch, dim, seqlen), "float32"), S((dim, 2), "float32"), S((dim, 2), "float32")
    yield "causal_conv1d_fwd[float32,width2]", lambda: causal_conv1d_fwd(x2, w2, x2)
    yield "causal_conv1d_bwd[float32,width2]", lambda: causal_conv1d_bwd(x2, w2, x2, x2, dw2)
    x1, state = S((batch, dim), "bfloat16"), S((batch, dim, 4), "bfloat16")
    w, bias, seqlens = S((dim, 4), "bfloat16"), S((dim,), "bfloat16"), S((batch,), "int32")
    yield "causal_conv1d_update[bfloat16]", lambda: causal_conv1d_update(x1, state, w, x1, bias, activation="silu")
    yield "causal_conv1d_update[bfloat16,circular]", \
        lambda: causal_conv1d_update(x1, state, w, x1, bias, activation="silu", cache_seqlens=seqlens)
    slots = S((3 * batch, dim, 4), "bfloat16")
    yield "causal_conv1d_update[bfloat16,conv_state_indices]", \
        lambda: causal_conv1d_update(x1, slots, w, x1, bias, activation="silu", conv_state_indices=seqlens)
    xb, wb, db = S((batch, dim, seqlen), "bfloat16"), S((dim, 4), "bfloat16"), S((dim,), "bfloat16")
    dwb, dbb = S((dim, 4), "float32"), S((dim,), "float32")
    work = S(bwd_workspace_shape(xb, wb), "float32")
    yield "causal_conv1d_bwd[bfloat16,first,deterministic]", \
        lambda: causal_conv1d_bwd(xb, wb, xb, xb, dwb, db, dbb, activation="silu", workspace=work)
    packed, cu = S((batch * seqlen, dim), "bfloat16"), S((batch + 1,), "int32")
    yield "causal_conv1d_varlen_states[bfloat16]", \
        lambda: causal_conv1d_varlen_states(packed, cu, S((batch, dim, 3), "bfloat16"))
