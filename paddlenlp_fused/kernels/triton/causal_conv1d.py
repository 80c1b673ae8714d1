"""Depthwise causal conv1d (Mamba's short conv): forward, backward and the decoding update.

Shapes (``b`` batch, ``d`` dim, ``l`` seqlen, ``w`` width, any width >= 1):
    x, out, dout, dx     [b, d, l]   any strides (channel-first ``l`` contiguous, or channel-last
                                     ``d`` contiguous: the tile shape follows the contiguous axis)
    weight               [d, w];  bias [d]
    seq_idx              [b, l] int32/int64: positions with different ids never mix (packed batches)
    initial_states       [b, d, w-1]: the inputs at positions -(w-1) .. -1 (zeros by default); they
                         continue the sequence of position 0

    out[b, d, t] = act(bias[d] + sum_k weight[d, k] * x[b, d, t - (w-1) + k]),  act = identity or silu,
    where x at a position of another sequence (``seq_idx``) counts as 0.

Memory-bound: the forward reads x once and writes out; the backward reads x and dout once,
recomputes the pre-activations, writes dx (and the initial states' gradient) and accumulates
dweight/dbias in registers, then with one fp32 atomic per program, dim and tap.

Decoding (``causal_conv1d_update``): x [b, d] or [b, d, s] new tokens; conv_state [b, d, state_len >=
w-1] holds the last inputs and is updated in place, either shifted (the last state_len inputs) or,
with ``cache_seqlens`` [b], as a circular buffer where token i goes to ``(cache_seqlens + i) % state_len``.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime import tensor as T

ACTIVATIONS = {None: False, "silu": True, "swish": True}


# Tiles are [ROWS, BLOCK_D]: ROWS consecutive positions held inside each thread, dims across the lanes.
# A program walks a segment of seqlen tile by tile and keeps the neighbouring tile in registers, so
# the shifted inputs x[t - s] (and, backward, the gradients at t + s) are register moves: one-hot
# integer selects over the in-thread row axis, which the compiler folds into plain copies.


@triton.jit
def _take_rows(a, b, OFFSET: tl.constexpr):
    """y[j] = concat(a, b)[j + OFFSET] along the row axis of two [ROWS, BLOCK_D] int32 tiles (the
    rows of b follow those of a): a one-hot integer sum, exact, and folded into register copies when
    the rows are in-thread."""
    ROWS: tl.constexpr = a.shape[0]
    j = tl.arange(0, ROWS)
    src = (j + OFFSET)[:, None]
    from_a = (j[None, :] == src)[:, :, None]
    from_b = (j[None, :] == src - ROWS)[:, :, None]
    return tl.sum(tl.where(from_a, a[None, :, :], tl.where(from_b, b[None, :, :], 0)), axis=1)


@triton.jit
def _take_rows_f32(a, b, OFFSET: tl.constexpr):
    return _take_rows(a.to(tl.int32, bitcast=True), b.to(tl.int32, bitcast=True), OFFSET).to(tl.float32,
                                                                                            bitcast=True)


@triton.jit
def _row(tile, k: tl.constexpr):
    """tile[k] of a [K, BLOCK_D] fp32 tile (rows in-thread) as [BLOCK_D]."""
    rows = tl.arange(0, tile.shape[0])
    return tl.sum(tl.where((rows == k)[:, None], tile.to(tl.int32, bitcast=True), 0), axis=0).to(
        tl.float32, bitcast=True)


@triton.jit
def _load_x(x_cols, init_cols, pos, mask_d, seqlen, s_x_l, s_i_k, HAS_INIT: tl.constexpr, WIDTH: tl.constexpr):
    """x at positions ``pos`` ([ROWS]; negative: the initial states, zeros without them) as fp32
    [ROWS, BLOCK_D]; 0 past seqlen."""
    pos64 = pos.to(tl.int64)
    v = tl.load(x_cols + pos64[:, None] * s_x_l, mask=((pos >= 0) & (pos < seqlen))[:, None] & mask_d[None, :],
                other=0.0).to(tl.float32)
    if HAS_INIT:
        before = (pos < 0) & (pos >= 1 - WIDTH)
        v += tl.load(init_cols + (pos64 + WIDTH - 1)[:, None] * s_i_k, mask=before[:, None] & mask_d[None, :],
                     other=0.0).to(tl.float32)
    return v


@triton.jit
def _load_sid(sid_row, pos, seqlen, s_si_l, HAS_SEQ_IDX: tl.constexpr):
    """Sequence ids of positions ``pos`` as [ROWS, 1] int32 (positions < 0 continue position 0's
    sequence; -1 past seqlen); unused zeros without seq_idx."""
    if HAS_SEQ_IDX:
        sid = tl.load(sid_row + tl.maximum(pos, 0).to(tl.int64) * s_si_l, mask=pos < seqlen, other=-1)
        sid = sid.to(tl.int32)[:, None]
    else:
        sid = tl.zeros([pos.shape[0], 1], dtype=tl.int32)
    return sid


@triton.jit
def _preact(x_prev, x_cur, sid_prev, sid_cur, w_tile, bias, HAS_SEQ_IDX: tl.constexpr, WIDTH: tl.constexpr):
    """bias + sum_s w[w-1-s] x[t - s] over the positions t of ``x_cur``, whose predecessors are in
    ``x_prev``; inputs of another sequence count as 0."""
    ROWS: tl.constexpr = x_cur.shape[0]
    acc = bias[None, :] + _row(w_tile, WIDTH - 1) * x_cur
    for s in tl.static_range(1, WIDTH):
        window = _take_rows_f32(x_prev, x_cur, ROWS - s)
        if HAS_SEQ_IDX:
            window = tl.where(_take_rows(sid_prev, sid_cur, ROWS - s) == sid_cur, window, 0.0)
        acc += _row(w_tile, WIDTH - 1 - s)[None, :] * window
    return acc


@triton.jit
def _causal_conv1d_fwd_kernel(x_ptr, w_ptr, bias_ptr, seq_idx_ptr, init_ptr, out_ptr,
                              dim, seqlen, s_x_b, s_x_d, s_x_l, s_w_d, s_w_k, s_si_b, s_si_l,
                              s_i_b, s_i_d, s_i_k, s_o_b, s_o_d, s_o_l,
                              WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                              HAS_INIT: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
                              ROWS: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_W: tl.constexpr):
    start = tl.program_id(0) * SEGMENT
    b64 = tl.program_id(2).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    rows = tl.arange(0, ROWS)
    x_cols = x_ptr + b64 * s_x_b + d64[None, :] * s_x_d
    init_cols = init_ptr + b64 * s_i_b + d64[None, :] * s_i_d
    sid_row = seq_idx_ptr + b64 * s_si_b
    o_cols = out_ptr + b64 * s_o_b + d64[None, :] * s_o_d
    ks = tl.arange(0, BLOCK_W)
    w_tile = tl.load(w_ptr + d64[None, :] * s_w_d + ks[:, None] * s_w_k, mask=(ks < WIDTH)[:, None] & mask_d[None, :],
                     other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32) if HAS_BIAS else \
        tl.zeros([BLOCK_D], dtype=tl.float32)

    x_prev = _load_x(x_cols, init_cols, start - ROWS + rows, mask_d, seqlen, s_x_l, s_i_k, HAS_INIT, WIDTH)
    sid_prev = _load_sid(sid_row, start - ROWS + rows, seqlen, s_si_l, HAS_SEQ_IDX)
    for i in range(SEGMENT // ROWS):
        pos = start + i * ROWS + rows
        x_cur = _load_x(x_cols, init_cols, pos, mask_d, seqlen, s_x_l, s_i_k, False, WIDTH)
        sid_cur = _load_sid(sid_row, pos, seqlen, s_si_l, HAS_SEQ_IDX)
        pre = _preact(x_prev, x_cur, sid_prev, sid_cur, w_tile, bias, HAS_SEQ_IDX, WIDTH)
        if SILU:
            pre = pre * tl.sigmoid(pre)
        tl.store(o_cols + pos.to(tl.int64)[:, None] * s_o_l, pre.to(out_ptr.dtype.element_ty),
                 mask=(pos < seqlen)[:, None] & mask_d[None, :])
        x_prev, sid_prev = x_cur, sid_cur


@triton.jit
def _dpre(x_prev, x_cur, sid_prev, sid_cur, dout, w_tile, bias, HAS_SEQ_IDX: tl.constexpr, SILU: tl.constexpr,
          WIDTH: tl.constexpr):
    """The gradient of the pre-activation at the positions of ``x_cur``."""
    if SILU:
        pre = _preact(x_prev, x_cur, sid_prev, sid_cur, w_tile, bias, HAS_SEQ_IDX, WIDTH)
        sig = tl.sigmoid(pre)
        dout = dout * sig * (1.0 + pre * (1.0 - sig))
    return dout


@triton.jit
def _dx(dpre_cur, dpre_next, sid_cur, sid_next, w_tile, HAS_SEQ_IDX: tl.constexpr, WIDTH: tl.constexpr):
    """dx[t] = sum_s w[w-1-s] dpre[t + s] over the positions of ``dpre_cur`` (same sequence only)."""
    acc = _row(w_tile, WIDTH - 1)[None, :] * dpre_cur
    for s in tl.static_range(1, WIDTH):
        ahead = _take_rows_f32(dpre_cur, dpre_next, s)
        if HAS_SEQ_IDX:
            ahead = tl.where(_take_rows(sid_cur, sid_next, s) == sid_cur, ahead, 0.0)
        acc += _row(w_tile, WIDTH - 1 - s)[None, :] * ahead
    return acc


@triton.jit
def _causal_conv1d_bwd_kernel(x_ptr, w_ptr, bias_ptr, seq_idx_ptr, init_ptr, dout_ptr, dx_ptr, dw_ptr, dbias_ptr,
                              dinit_ptr, dim, seqlen, s_x_b, s_x_d, s_x_l, s_w_d, s_w_k, s_si_b, s_si_l,
                              s_i_b, s_i_d, s_i_k, s_do_b, s_do_d, s_do_l, s_dx_b, s_dx_d, s_dx_l,
                              s_di_b, s_di_d, s_di_k,
                              WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_SEQ_IDX: tl.constexpr,
                              HAS_INIT: tl.constexpr, SILU: tl.constexpr, BLOCK_D: tl.constexpr,
                              ROWS: tl.constexpr, SEGMENT: tl.constexpr, BLOCK_W: tl.constexpr):
    pid_s = tl.program_id(0)
    start = pid_s * SEGMENT
    b64 = tl.program_id(2).to(tl.int64)
    d = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    rows = tl.arange(0, ROWS)
    x_cols = x_ptr + b64 * s_x_b + d64[None, :] * s_x_d
    init_cols = init_ptr + b64 * s_i_b + d64[None, :] * s_i_d
    sid_row = seq_idx_ptr + b64 * s_si_b
    do_cols = dout_ptr + b64 * s_do_b + d64[None, :] * s_do_d
    dx_cols = dx_ptr + b64 * s_dx_b + d64[None, :] * s_dx_d
    ks = tl.arange(0, BLOCK_W)
    w_tile = tl.load(w_ptr + d64[None, :] * s_w_d + ks[:, None] * s_w_k, mask=(ks < WIDTH)[:, None] & mask_d[None, :],
                     other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32) if HAS_BIAS else \
        tl.zeros([BLOCK_D], dtype=tl.float32)

    # tiles prev (inputs before the segment), cur (the first tile) and, in the loop, next
    x_prev = _load_x(x_cols, init_cols, start - ROWS + rows, mask_d, seqlen, s_x_l, s_i_k, HAS_INIT, WIDTH)
    sid_prev = _load_sid(sid_row, start - ROWS + rows, seqlen, s_si_l, HAS_SEQ_IDX)
    pos = start + rows
    x_cur = _load_x(x_cols, init_cols, pos, mask_d, seqlen, s_x_l, s_i_k, False, WIDTH)
    sid_cur = _load_sid(sid_row, pos, seqlen, s_si_l, HAS_SEQ_IDX)
    dout = tl.load(do_cols + pos.to(tl.int64)[:, None] * s_do_l, mask=(pos < seqlen)[:, None] & mask_d[None, :],
                   other=0.0).to(tl.float32)
    dpre_cur = _dpre(x_prev, x_cur, sid_prev, sid_cur, dout, w_tile, bias, HAS_SEQ_IDX, SILU, WIDTH)
    if HAS_INIT:  # the first segment also owns the initial states: positions -(w-1) .. -1
        if pid_s == 0:
            dinit = _dx(tl.zeros([ROWS, BLOCK_D], dtype=tl.float32), dpre_cur, sid_prev, sid_cur, w_tile,
                        HAS_SEQ_IDX, WIDTH)
            ipos = rows - ROWS + WIDTH - 1  # state slot of each row of the tile before position 0
            tl.store(dinit_ptr + b64 * s_di_b + d64[None, :] * s_di_d + ipos.to(tl.int64)[:, None] * s_di_k,
                     dinit.to(dinit_ptr.dtype.element_ty), mask=(ipos >= 0)[:, None] & mask_d[None, :])

    dw_acc = tl.zeros([BLOCK_W, BLOCK_D], dtype=tl.float32)
    dbias_acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for i in range(SEGMENT // ROWS):
        pos = start + i * ROWS + rows
        # dweight[k] += dpre[t] x[t - (w-1) + k]
        for s in tl.static_range(WIDTH):
            if s == 0:
                window = x_cur
            else:
                window = _take_rows_f32(x_prev, x_cur, ROWS - s)
                if HAS_SEQ_IDX:
                    window = tl.where(_take_rows(sid_prev, sid_cur, ROWS - s) == sid_cur, window, 0.0)
            dw_acc += tl.where((ks == WIDTH - 1 - s)[:, None], tl.sum(dpre_cur * window, axis=0)[None, :], 0.0)
        dbias_acc += dpre_cur
        # the next tile's dpre (the look-ahead of dx), then dx of this tile
        pos_next = pos + ROWS
        x_next = _load_x(x_cols, init_cols, pos_next, mask_d, seqlen, s_x_l, s_i_k, False, WIDTH)
        sid_next = _load_sid(sid_row, pos_next, seqlen, s_si_l, HAS_SEQ_IDX)
        dout = tl.load(do_cols + pos_next.to(tl.int64)[:, None] * s_do_l,
                       mask=(pos_next < seqlen)[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
        dpre_next = _dpre(x_cur, x_next, sid_cur, sid_next, dout, w_tile, bias, HAS_SEQ_IDX, SILU, WIDTH)
        dx = _dx(dpre_cur, dpre_next, sid_cur, sid_next, w_tile, HAS_SEQ_IDX, WIDTH)
        tl.store(dx_cols + pos.to(tl.int64)[:, None] * s_dx_l, dx.to(dx_ptr.dtype.element_ty),
                 mask=(pos < seqlen)[:, None] & mask_d[None, :])
        x_prev, x_cur, sid_prev, sid_cur, dpre_cur = x_cur, x_next, sid_cur, sid_next, dpre_next

    tl.atomic_add(dw_ptr + d64[None, :] * WIDTH + ks[:, None], dw_acc, mask=(ks < WIDTH)[:, None] & mask_d[None, :],
                  sem="relaxed")
    if HAS_BIAS:
        tl.atomic_add(dbias_ptr + d, tl.sum(dbias_acc, axis=0), mask=mask_d, sem="relaxed")


@triton.jit
def _causal_conv1d_update_kernel(x_ptr, state_ptr, w_ptr, bias_ptr, cache_seqlens_ptr, out_ptr,
                                 dim, steps, state_len, s_x_b, s_x_d, s_x_l, s_st_b, s_st_d, s_st_l,
                                 s_w_d, s_w_k, s_o_b, s_o_d, s_o_l,
                                 WIDTH: tl.constexpr, HAS_BIAS: tl.constexpr, SILU: tl.constexpr,
                                 CIRCULAR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
                                 BLOCK_STATE: tl.constexpr):
    b = tl.program_id(1)
    b64 = b.to(tl.int64)
    d = tl.program_id(0) * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    i = tl.arange(0, BLOCK_S)  # new tokens
    x_rows = x_ptr + b64 * s_x_b + d64[:, None] * s_x_d
    st_rows = state_ptr + b64 * s_st_b + d64[:, None] * s_st_d
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
        v2 = tl.load(st_rows + slot.to(tl.int64)[None, :] * s_st_l, mask=live & (q < 0)[None, :], other=0.0)
        w_k = tl.load(w_ptr + d64 * s_w_d + k * s_w_k, mask=mask_d, other=0.0).to(tl.float32)
        acc += w_k[:, None] * (v.to(tl.float32) + v2.to(tl.float32))
    if SILU:
        acc = acc * tl.sigmoid(acc)
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
                 mask=mask_d[:, None] & kept[None, :])
    else:  # new_state[j] = concat(state, x)[j + steps]
        src = j + steps
        from_state = src < state_len
        keep = tl.load(st_rows + tl.minimum(src, state_len - 1).to(tl.int64)[None, :] * s_st_l,
                       mask=mask_d[:, None] & (from_state & (j < state_len))[None, :], other=0.0)
        new = tl.load(x_rows + tl.maximum(src - state_len, 0).to(tl.int64)[None, :] * s_x_l,
                      mask=mask_d[:, None] & (~from_state & (j < state_len))[None, :], other=0.0)
        tl.debug_barrier()
        tl.store(st_rows + j.to(tl.int64)[None, :] * s_st_l,
                 tl.where(from_state[None, :], keep.to(state_ptr.dtype.element_ty), new.to(state_ptr.dtype.element_ty)),
                 mask=mask_d[:, None] & (j < state_len)[None, :])


# ----------------------------------------------------------------------------------------------
# launchers

SEGMENT = 256  # positions a program walks (it also loads the tile before and, backward, after)


def _or(t, stand_in):
    """An absent optional tensor as the kernel takes it: a stand-in pointer that its constexpr flag
    keeps from being read (the kernels form row pointers before branching on the flags)."""
    return stand_in if t is None else t


def _check_activation(activation):
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected None, 'silu' or 'swish', got {activation!r}")
    return ACTIVATIONS[activation]


def _tiles(dim: int, seqlen: int, width: int, block_d=None, segment=None):
    """(BLOCK_D, ROWS, SEGMENT, BLOCK_W, num_warps). ROWS = 8 positions a thread (16 bytes of
    bf16 along a channel-first row) and at least w - 1, so a tile and the one before hold every
    shifted input; 32 dims a warp."""
    rows = max(8, triton.next_power_of_2(max(width - 1, 1)))
    block_d = block_d or max(1, min(64, triton.next_power_of_2(dim)))
    segment = segment or max(rows, min(SEGMENT, triton.next_power_of_2(seqlen)))
    if segment % rows or block_d & (block_d - 1):
        raise ValueError(f"segment, block_d: expected a multiple of {rows} and a power of two, got {segment}, "
                         f"{block_d}")
    return block_d, rows, segment, triton.next_power_of_2(width), max(1, min(4, block_d // 32))


def _conv_args(x, weight, bias, seq_idx, initial_states):
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
                      block_d=None, segment=None) -> None:
    """out[b, d, l] = act(causal depthwise conv of x), written in place."""
    silu = _check_activation(activation)
    batch, dim, seqlen, width, si_st, init_st = _conv_args(x, weight, bias, seq_idx, initial_states)
    T.check_same_shape("out", out, (batch, dim, seqlen))
    if batch * dim * seqlen == 0:
        return
    block_d, rows, segment, block_w, warps = _tiles(dim, seqlen, width, block_d, segment)
    grid = (triton.cdiv(seqlen, segment), triton.cdiv(dim, block_d), batch)
    _causal_conv1d_fwd_kernel[grid](x, weight, _or(bias, x), _or(seq_idx, x), _or(initial_states, x), out, dim,
                                    seqlen, *T.strides(x), *T.strides(weight), *si_st, *init_st, *T.strides(out),
                                    WIDTH=width, HAS_BIAS=bias is not None, HAS_SEQ_IDX=seq_idx is not None,
                                    HAS_INIT=initial_states is not None, SILU=silu, BLOCK_D=block_d, ROWS=rows,
                                    SEGMENT=segment, BLOCK_W=block_w, num_warps=warps)


def causal_conv1d_bwd(x, weight, dout, dx, dweight, bias=None, dbias=None, seq_idx=None, initial_states=None,
                      dinitial_states=None, activation=None, block_d=None, segment=None) -> None:
    """Gradients of the conv. Written in place: dx [b, d, l] and dinitial_states [b, d, w-1] (when
    initial_states is given). Accumulated (+=, float32 contiguous, the caller zeroes them):
    dweight [d, w] and dbias [d] (when bias is given)."""
    silu = _check_activation(activation)
    batch, dim, seqlen, width, si_st, init_st = _conv_args(x, weight, bias, seq_idx, initial_states)
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
    if (initial_states is None) != (dinitial_states is None):
        raise ValueError("dinitial_states: expected exactly when initial_states is given")
    di_st = (0, 0, 0)
    if dinitial_states is not None:
        T.check_same_shape("dinitial_states", dinitial_states, (batch, dim, width - 1))
        di_st = T.strides(dinitial_states)
    if batch * dim * seqlen == 0:
        return
    block_d, rows, segment, block_w, warps = _tiles(dim, seqlen, width, block_d, segment)
    grid = (triton.cdiv(seqlen, segment), triton.cdiv(dim, block_d), batch)
    _causal_conv1d_bwd_kernel[grid](x, weight, _or(bias, x), _or(seq_idx, x), _or(initial_states, x), dout, dx,
                                    dweight, _or(dbias, x), _or(dinitial_states, x), dim, seqlen,
                                    *T.strides(x), *T.strides(weight), *si_st, *init_st, *T.strides(dout),
                                    *T.strides(dx), *di_st,
                                    WIDTH=width, HAS_BIAS=bias is not None, HAS_SEQ_IDX=seq_idx is not None,
                                    HAS_INIT=initial_states is not None, SILU=silu, BLOCK_D=block_d, ROWS=rows,
                                    SEGMENT=segment, BLOCK_W=block_w, num_warps=warps)


def causal_conv1d_update(x, conv_state, weight, out, bias=None, activation=None, cache_seqlens=None) -> None:
    """Decoding: out (x's shape, [b, d] or [b, d, s]) from the new tokens x and conv_state
    [b, d, state_len >= w - 1], which is updated in place (shifted, or a ring buffer indexed by
    ``cache_seqlens`` [b])."""
    silu = _check_activation(activation)
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
    if len(st_dims) != 3 or st_dims[:2] != (batch, dim) or st_dims[2] < width - 1:
        raise ValueError(f"conv_state: expected [batch={batch}, dim={dim}, state_len >= width - 1 = {width - 1}], "
                         f"got shape {st_dims}")
    if bias is not None:
        T.check_same_shape("bias", bias, (dim,))
    if cache_seqlens is not None:
        T.check_same_shape("cache_seqlens", cache_seqlens, (batch,))
        if T.dtype_name(cache_seqlens) not in ("int32", "int64"):
            raise TypeError(f"cache_seqlens: expected int32 or int64, got {T.dtype_name(cache_seqlens)}")
    state_len = st_dims[2]
    if batch * dim == 0 or steps == 0:
        return
    block_s, block_state = triton.next_power_of_2(steps), triton.next_power_of_2(max(state_len, 1))
    block_d = max(1, min(triton.next_power_of_2(dim), 4096 // max(block_s, block_state)))
    _causal_conv1d_update_kernel[(triton.cdiv(dim, block_d), batch)](
        x, conv_state, weight, bias, cache_seqlens, out, dim, steps, state_len, *x_st, *T.strides(conv_state),
        *T.strides(weight), *o_st, WIDTH=width, HAS_BIAS=bias is not None, SILU=silu,
        CIRCULAR=cache_seqlens is not None, BLOCK_D=block_d, BLOCK_S=block_s, BLOCK_STATE=block_state,
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
