"""Mamba-2 SSD (state-space duality) forward: the chunked scan in five stages, plus states at chosen
token positions (per-sequence final states of packed rows).

Shapes (``b`` batch, ``l`` seqlen, ``h`` nheads, ``p`` headdim, ``g`` ngroups dividing h, ``n`` dstate,
``K`` chunk_size, ``c`` nchunks = ceil(l / K)); every tensor contiguous:

    x, z, out, out_x          [b, l, h, p]       x's dtype (out_x: y before the z gate)
    dt                        [b, l, h]          any float dtype
    A, dt_bias                [h]
    B, C                      [b, l, g, n]       head ``hd`` reads group ``hd // (h / g)``
    D                         [h] or [h, p]
    initial_states            [b, h, p, n]
    seq_idx                   [b, l] int32/int64 run ids: equal values share a state only within one
                              run (the op numbers the runs, so ids never repeat after a change)
    dt_out, dA_cumsum         [b, h, c, K] fp32  processed dt (0 past l); inclusive cumsum of dt*A per chunk
    CB                        [b, c, g, K, K] fp32  C_t . B_s inside each chunk (unmasked)
    states                    [b, c, h, p, n] fp32, or x's dtype (``states_dtype``): the state entering each chunk
    final_states              [b, h, p, n] fp32  the state after the last token

Recurrence (per head): ``h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T``, ``y_t = h_t C_t + D x_t``, then
``y_t * silu(z_t)``; ``dt = clip(softplus?(dt + dt_bias), dt_limit)``.

Stages (one launch each), with ``cs`` = dA_cumsum:
 1. chunk cumsum: dt processed, ``cs`` within each chunk.
 2. CB: ``C_t . B_s`` per chunk and group (shared by the group's heads).
 3. chunk states: each chunk's own end state from zero, ``sum_s exp(cs_end - cs_s) dt_s x_s B_s^T``,
    written where stage 4 reads it: into ``states[:, c + 1]`` (the last chunk's into final_states),
    so no workspace is needed.
 4. state passing: sequential over chunks, parallel over (b, h, p*n):
    ``states[c + 1] = carry_c states[c] + own_c`` with ``carry_c = exp(cs_end of c)``, zeroed when a
    new run ends chunk c (seq_idx), exactly as the reference.
 3+4 fused (once batch * nheads >= FUSED_MIN_ROWS, or ``SSDConfig.fuse_state_passing``): one program
    per (p, n) tile, batch and head walks all tokens, the state in registers; half the memory traffic
    of 3 and 4.
 5. chunk scan: ``y_t = sum_{s<=t, same run} CB_ts exp(cs_t - cs_s) dt_s x_s
    + exp(cs_t) C_t states[c]^T (if t is in the run that entered the chunk) + D x_t``, then the gate.
    By default a program walks the token tiles of one chunk (entering state read once), loads the CB
    blocks of stage 2, and the programs of all heads of a chunk run side by side (shared C/B/CB tiles
    from L2); ``SSDConfig`` can instead recompute the CB blocks from the C tile in registers
    (attention-style) or give each token tile its own program.

Stages 3, 3+4 and 5 are autotuned (``triton.autotune``) on the GPU for 16-bit inputs once batch *
nchunks * nheads reaches ``TUNE_MIN_PROGRAMS`` and no ``config`` is given; otherwise they take
``SSDConfig``'s tiles. Both live in ``ssd_tuning.py``.

Matmuls run on ``tl.dot`` with 16-bit operands for 16-bit inputs (the fp32 decay-weighted factors and
the fp32 entering state are rounded to x's dtype, as an fp32-accumulating bf16 GEMM would; optionally
the bf16 intra-chunk weights go in as two terms, ``SSDConfig.split_scores``) and IEEE fp32 for fp32
inputs; accumulation, states and cumsums are fp32. Offsets: 64-bit bases, 32-bit offsets inside a chunk
(the launcher checks chunk_size * nheads * headdim and chunk_size * ngroups * dstate fit).
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import triton
import triton.language as tl

from ...runtime import tensor as T
from .interpreter_compat import INTERPRETING, dot_operand
from .ssd_tuning import (DEFAULT_CONFIG, FUSED_CONFIGS, FUSED_MIN_ROWS, SCAN_CONFIGS, STATE_CONFIGS,
                         TUNE_MIN_PROGRAMS, SSDConfig)


_ONE_DSTATE_TILE_MAX = 256  # dstate up to which the chunk scan may hold all of it in one tile
# the interpreter runs every program in Python: big tiles, few programs
_INTERPRETER_TILE = 16


@triton.jit
def _process_dt(dt, bias, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr, HAS_LIMIT: tl.constexpr,
                dt_min, dt_max):
    if HAS_BIAS:
        dt += bias
    if DT_SOFTPLUS:  # linear above 20 as torch/paddle softplus; the exp overflow there is discarded
        dt = tl.where(dt <= 20.0, tl.log(1.0 + tl.exp(tl.minimum(dt, 20.0))), dt)
    if HAS_LIMIT:
        dt = tl.minimum(tl.maximum(dt, dt_min), dt_max)
    return dt


@triton.jit
def _chunk_cumsum_kernel(dt_ptr, A_ptr, dt_bias_ptr, dt_out_ptr, cs_ptr, seqlen, nheads, nchunks, dt_min, dt_max,
                         CHUNK: tl.constexpr, HAS_BIAS: tl.constexpr, DT_SOFTPLUS: tl.constexpr,
                         HAS_LIMIT: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr):
    """Program (batch, chunk, block of heads): dt_out and the running sum of dt*A in BLOCK_T steps."""
    pid_b, pid_c, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    heads = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    hmask = heads < nheads
    A = tl.load(A_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    bias = tl.zeros([BLOCK_H], dtype=tl.float32)
    if HAS_BIAS:
        bias = tl.load(dt_bias_ptr + heads, mask=hmask, other=0.0).to(tl.float32)
    # [b, h, c, K] rows of this chunk, one per head
    out_rows = ((pid_b * nheads + heads).to(tl.int64) * nchunks + pid_c) * CHUNK
    carry = tl.zeros([BLOCK_H], dtype=tl.float32)
    for k0 in range(0, CHUNK, BLOCK_T):
        k = k0 + tl.arange(0, BLOCK_T)
        tok = pid_c * CHUNK + k
        valid = (tok < seqlen)[:, None] & hmask[None, :]
        rows = pid_b.to(tl.int64) * seqlen + tok
        dt = tl.load(dt_ptr + rows[:, None] * nheads + heads[None, :], mask=valid, other=0.0).to(tl.float32)
        dt = tl.where(valid, _process_dt(dt, bias[None, :], HAS_BIAS, DT_SOFTPLUS, HAS_LIMIT, dt_min, dt_max), 0.0)
        dA = dt * A[None, :]
        cs = tl.cumsum(dA, axis=0) + carry[None, :]
        carry += tl.sum(dA, axis=0)
        offs = out_rows[None, :] + k[:, None]
        tl.store(dt_out_ptr + offs, dt, mask=hmask[None, :])
        tl.store(cs_ptr + offs, cs, mask=hmask[None, :])


@triton.jit
def _chunk_cb_kernel(C_ptr, B_ptr, CB_ptr, seqlen, nchunks, ngroups, dstate, CHUNK: tl.constexpr,
                     DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr,
                     BLOCK_N: tl.constexpr):
    """Program (tile of [t, s], batch*chunk, group): CB[t, s] = C_t . B_s over dstate in BLOCK_N steps."""
    pid_ts, pid_bc, pid_g = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    tiles_s = CHUNK // BLOCK_S
    t = (pid_ts // tiles_s) * BLOCK_M + tl.arange(0, BLOCK_M)
    s = (pid_ts % tiles_s) * BLOCK_S + tl.arange(0, BLOCK_S)
    pid_b, pid_c = pid_bc // nchunks, pid_bc % nchunks
    tok_t, tok_s = pid_c * CHUNK + t, pid_c * CHUNK + s
    rows_t = (pid_b.to(tl.int64) * seqlen + tok_t) * ngroups + pid_g
    rows_s = (pid_b.to(tl.int64) * seqlen + tok_s) * ngroups + pid_g
    acc = tl.zeros([BLOCK_M, BLOCK_S], dtype=tl.float32)
    for n0 in range(0, dstate, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)
        c = tl.load(C_ptr + rows_t[:, None] * dstate + n[None, :],
                    mask=(tok_t < seqlen)[:, None] & (n < dstate)[None, :], other=0.0)
        b = tl.load(B_ptr + rows_s[None, :] * dstate + n[:, None],
                    mask=(tok_s < seqlen)[None, :] & (n < dstate)[:, None], other=0.0)
        acc = tl.dot(dot_operand(c), dot_operand(b), acc, input_precision=DOT_PRECISION)
    out_rows = ((pid_b.to(tl.int64) * nchunks + pid_c) * ngroups + pid_g) * CHUNK + t
    tl.store(CB_ptr + out_rows[:, None] * CHUNK + s[None, :], acc)


@triton.jit
def _add_decayed_xb(acc, x_rows, B_rows, k, kmask, keep, cs_end, cs_k, dt_k, p, pmask, n, nmask, x_stride,
                    bc_stride, DOT_PRECISION: tl.constexpr):
    """acc [p, n] + sum over the block's tokens k (rows k of x_rows and B_rows) of exp(cs_end - cs_k) dt_k
    x_k B_k^T, the tokens not kept weighing 0 (masked before exp: past the end cs_end - cs_k may be
    positive and overflow). The weight rides on B, rounded to x's dtype for the product."""
    weight = tl.exp(tl.where(keep, cs_end - cs_k, float("-inf"))) * dt_k
    xt = tl.load(x_rows + k[None, :] * x_stride + p[:, None], mask=pmask[:, None] & kmask[None, :],
                 other=0.0)                                                               # [p, k]
    b = tl.load(B_rows + k[:, None] * bc_stride + n[None, :], mask=kmask[:, None] & nmask[None, :],
                other=0.0).to(tl.float32)                                                 # [k, n]
    bw = (b * weight[:, None]).to(xt.dtype)
    return tl.dot(dot_operand(xt), dot_operand(bw), acc, input_precision=DOT_PRECISION)


@triton.jit
def _own_state(x_ptr, B_ptr, dt_out_ptr, cs_ptr, seq_ptr, pid_b, pid_c, pid_h, t_end, p, n, seqlen, nheads, headdim,
               ngroups, dstate, nchunks, CHUNK: tl.constexpr, HAS_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
               BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """The [p, n] tile of ``sum_{k <= t_end, same run as t_end} exp(cs_end - cs_k) dt_k x_k B_k^T``
    over chunk ``pid_c`` (fp32), and cs_end."""
    pmask, nmask = p < headdim, n < dstate
    group = pid_h // (nheads // ngroups)
    chunk_row = ((pid_b * nheads + pid_h).to(tl.int64) * nchunks + pid_c) * CHUNK  # [b, h, c, K]
    cs_end = tl.load(cs_ptr + chunk_row + t_end)
    if HAS_SEQ:
        seq_row = seq_ptr + pid_b.to(tl.int64) * seqlen
        seg_end = tl.load(seq_row + tl.minimum(pid_c * CHUNK + t_end, seqlen - 1))
    # scalar 64-bit bases of the chunk's first token, 32-bit offsets inside the chunk
    first_row = (pid_b * seqlen).to(tl.int64) + pid_c * CHUNK
    x_stride, bc_stride = nheads * headdim, ngroups * dstate
    x_base = x_ptr + first_row * x_stride + pid_h * headdim
    B_base = B_ptr + first_row * bc_stride + group * dstate
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, t_end + 1, BLOCK_K):
        k = k0 + tl.arange(0, BLOCK_K)
        tok = pid_c * CHUNK + k
        kmask = (k <= t_end) & (tok < seqlen)
        cs_k = tl.load(cs_ptr + chunk_row + k, mask=kmask, other=0.0)
        dt_k = tl.load(dt_out_ptr + chunk_row + k, mask=kmask, other=0.0)
        keep = kmask
        if HAS_SEQ:
            keep = keep & (tl.load(seq_row + tok, mask=kmask, other=0) == seg_end)
        acc = _add_decayed_xb(acc, x_base, B_base, k, kmask, keep, cs_end, cs_k, dt_k, p, pmask, n, nmask, x_stride,
                              bc_stride, DOT_PRECISION)
    return acc, cs_end


@triton.jit
def _tile_of(pid_pn, dstate, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    tiles_n = tl.cdiv(dstate, BLOCK_N)
    p = (pid_pn // tiles_n) * BLOCK_P + tl.arange(0, BLOCK_P)
    n = (pid_pn % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return p, n


@triton.jit
def _chunk_state_kernel(x_ptr, B_ptr, dt_out_ptr, cs_ptr, seq_ptr, states_ptr, final_ptr, pos_ptr, at_ptr,
                        seqlen, nheads, headdim, ngroups, dstate, nchunks, ncols, CHUNK: tl.constexpr,
                        HAS_SEQ: tl.constexpr, AT_POSITIONS: tl.constexpr, DOT_PRECISION: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Program (tile of [p, n], batch*column, head).

    Without AT_POSITIONS a column is a chunk: its own end state from zero, stored for the state
    passing (``states[:, c + 1]``, the last chunk's in final_states). With AT_POSITIONS a column is a
    token position ``pos_ptr[i]``: the state right after it, i.e. its chunk's tokens up to it plus the
    decayed entering state when the token is in the run that entered the chunk, stored in ``at_ptr``
    [b, ncols, h, p, n]."""
    pid_pn, pid_bi, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p, n = _tile_of(pid_pn, dstate, BLOCK_P, BLOCK_N)
    pid_b, pid_i = pid_bi // ncols, pid_bi % ncols
    if AT_POSITIONS:
        pos = tl.load(pos_ptr + pid_i).to(tl.int32)
        pid_c, t_end = pos // CHUNK, pos % CHUNK
    else:
        pid_c, t_end = pid_i, CHUNK - 1
    acc, cs_end = _own_state(x_ptr, B_ptr, dt_out_ptr, cs_ptr, seq_ptr, pid_b, pid_c, pid_h, t_end, p, n, seqlen,
                             nheads, headdim, ngroups, dstate, nchunks, CHUNK, HAS_SEQ, DOT_PRECISION,
                             BLOCK_P, BLOCK_N, BLOCK_K)
    tile = p[:, None] * dstate + n[None, :]
    tile_mask = (p < headdim)[:, None] & (n < dstate)[None, :]
    head_state = (pid_b * nheads + pid_h).to(tl.int64) * headdim * dstate  # into [b, h, p, n]
    if AT_POSITIONS:
        from_start = cs_end
        entering = (((pid_b * nchunks + pid_c).to(tl.int64) * nheads + pid_h) * headdim) * dstate
        carried = tl.load(states_ptr + entering + tile, mask=tile_mask, other=0.0).to(tl.float32)
        if HAS_SEQ:  # in the run of the token just before the chunk (the first token's for chunk 0)?
            seq_row = seq_ptr + pid_b.to(tl.int64) * seqlen
            seg_end = tl.load(seq_row + pid_c * CHUNK + t_end)
            seg_prev = tl.load(seq_row + tl.maximum(pid_c * CHUNK - 1, 0))
            from_start = tl.where(seg_end == seg_prev, cs_end, float("-inf"))
        acc += tl.exp(from_start) * carried
        out = (((pid_b * ncols + pid_i).to(tl.int64) * nheads + pid_h) * headdim) * dstate
        tl.store(at_ptr + out + tile, acc, mask=tile_mask)
    elif pid_c == nchunks - 1:
        tl.store(final_ptr + head_state + tile, acc, mask=tile_mask)
    else:
        nxt = (((pid_b * nchunks + pid_c + 1).to(tl.int64) * nheads + pid_h) * headdim) * dstate
        tl.store(states_ptr + nxt + tile, acc, mask=tile_mask)


@triton.jit
def _fused_state_passing_kernel(x_ptr, B_ptr, dt_out_ptr, cs_ptr, seq_ptr, init_ptr, states_ptr, final_ptr,
                                seqlen, nheads, headdim, ngroups, dstate, nchunks, CHUNK: tl.constexpr,
                                HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr, DOT_PRECISION: tl.constexpr,
                                BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """Stages 3 and 4 in one: program (tile of [p, n], batch, head) walks the tokens in blocks of
    BLOCK_K (dividing CHUNK) in one flat loop, so the loads pipeline across chunk boundaries and the
    state never leaves registers. Per block, with ``cs`` restarting at each chunk (``cs_before`` = 0
    at a chunk start): ``h <- exp(cs_blockend - cs_before) h + sum_k exp(cs_blockend - cs_k) dt_k x_k B_k^T``;
    at each chunk start h is stored as the entering state (and dropped when a new run ends the chunk).
    With seq_idx only the tokens of the run ending the chunk count, as in stage 3: the run ids are
    unique, so the earlier tokens of that run are exactly the ones h already holds."""
    pid_pn, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    p, n = _tile_of(pid_pn, dstate, BLOCK_P, BLOCK_N)
    pmask, nmask = p < headdim, n < dstate
    tile = p[:, None] * dstate + n[None, :]
    tile_mask = pmask[:, None] & nmask[None, :]
    head_state = (pid_b * nheads + pid_h).to(tl.int64) * headdim * dstate
    if HAS_INIT:
        h = tl.load(init_ptr + head_state + tile, mask=tile_mask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    group = pid_h // (nheads // ngroups)
    x_stride, bc_stride = nheads * headdim, ngroups * dstate
    first_row = (pid_b * seqlen).to(tl.int64)
    x_base = x_ptr + first_row * x_stride + pid_h * headdim
    B_base = B_ptr + first_row * bc_stride + group * dstate
    cs_base = (pid_b * nheads + pid_h).to(tl.int64) * nchunks * CHUNK  # [b, h, c, K] rows: padded tokens
    # entering state of chunk c at states_base + c * chunk_stride ([b, c, h, p, n])
    chunk_stride = nheads * headdim * dstate
    states_base = states_ptr + (pid_b * nchunks).to(tl.int64) * chunk_stride + pid_h * headdim * dstate + tile
    if HAS_SEQ:
        seq_row = seq_ptr + first_row
    # the block's first row, advanced by pointer: k * x_stride passes 2^31 on long rows, while
    # kk * x_stride < chunk_size * x_stride fits in 32 bits (the launcher checks)
    x_blk, B_blk = x_base, B_base
    for k0 in range(0, nchunks * CHUNK, BLOCK_K):
        kk = tl.arange(0, BLOCK_K)
        k = k0 + kk  # token index (past seqlen inside the last chunk: dt 0)
        kmask = k < seqlen
        chunk_start = k0 % CHUNK == 0
        c = k0 // CHUNK
        # branch-free so the loop stays one software pipeline: a masked store, a select
        tl.store(states_base + c.to(tl.int64) * chunk_stride, h.to(states_ptr.dtype.element_ty),
                 mask=tile_mask & chunk_start)
        cs_before = tl.load(cs_ptr + cs_base + tl.maximum(k0 - 1, 0))
        cs_before = tl.where(chunk_start, 0.0, cs_before)
        cs_blockend = tl.load(cs_ptr + cs_base + k0 + BLOCK_K - 1)
        cs_k = tl.load(cs_ptr + cs_base + k)
        dt_k = tl.load(dt_out_ptr + cs_base + k)
        keep = kmask
        if HAS_SEQ:
            seg_end = tl.load(seq_row + tl.minimum(c * CHUNK + CHUNK - 1, seqlen - 1))
            seg_prev = tl.load(seq_row + tl.maximum(c * CHUNK - 1, 0))
            h = tl.where(chunk_start & (seg_end != seg_prev), 0.0, h)
            keep = keep & (tl.load(seq_row + k, mask=kmask, other=0) == seg_end)
        h = _add_decayed_xb(h * tl.exp(cs_blockend - cs_before), x_blk, B_blk, kk, kmask, keep, cs_blockend, cs_k,
                            dt_k, p, pmask, n, nmask, x_stride, bc_stride, DOT_PRECISION)
        x_blk += BLOCK_K * x_stride
        B_blk += BLOCK_K * bc_stride
    tl.store(final_ptr + head_state + tile, h, mask=tile_mask)


@triton.jit
def _chunk_carry(cs_ptr, chunk_row_0, seq_ptr, pid_b, c, seqlen, CHUNK: tl.constexpr, HAS_SEQ: tl.constexpr):
    """exp(cs at the end of chunk c), zeroed when the run ending chunk c is not the one that entered it."""
    carry = tl.exp(tl.load(cs_ptr + chunk_row_0 + c * CHUNK + CHUNK - 1))
    if HAS_SEQ:
        seq_row = seq_ptr + pid_b.to(tl.int64) * seqlen
        seg_end = tl.load(seq_row + tl.minimum(c * CHUNK + CHUNK - 1, seqlen - 1))
        seg_prev = tl.load(seq_row + tl.maximum(c * CHUNK - 1, 0))
        carry = tl.where(seg_end == seg_prev, carry, 0.0)
    return carry


@triton.jit
def _state_passing_kernel(states_ptr, final_ptr, init_ptr, cs_ptr, seq_ptr, seqlen, nheads, nchunks, state_size,
                          CHUNK: tl.constexpr, HAS_INIT: tl.constexpr, HAS_SEQ: tl.constexpr,
                          BLOCK: tl.constexpr):
    """Program (block of p*n, batch, head): walks the chunks; ``states[c + 1]`` (and final_states for
    the last chunk) hold the chunk's own end state on entry and the carried state on exit."""
    pid_e, pid_b, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    e = pid_e * BLOCK + tl.arange(0, BLOCK)
    emask = e < state_size
    head_state = (pid_b * nheads + pid_h).to(tl.int64) * state_size + e
    if HAS_INIT:
        h = tl.load(init_ptr + head_state, mask=emask, other=0.0).to(tl.float32)
    else:
        h = tl.zeros([BLOCK], dtype=tl.float32)
    chunk_row_0 = (pid_b * nheads + pid_h).to(tl.int64) * nchunks * CHUNK
    tl.store(states_ptr + ((pid_b * nchunks).to(tl.int64) * nheads + pid_h) * state_size + e, h, mask=emask)
    for c in range(0, nchunks - 1):
        ptrs = states_ptr + ((pid_b * nchunks + c + 1).to(tl.int64) * nheads + pid_h) * state_size + e
        own = tl.load(ptrs, mask=emask, other=0.0)
        h = _chunk_carry(cs_ptr, chunk_row_0, seq_ptr, pid_b, c, seqlen, CHUNK, HAS_SEQ) * h + own
        tl.store(ptrs, h, mask=emask)
    own = tl.load(final_ptr + head_state, mask=emask, other=0.0)
    h = _chunk_carry(cs_ptr, chunk_row_0, seq_ptr, pid_b, nchunks - 1, seqlen, CHUNK, HAS_SEQ) * h + own
    tl.store(final_ptr + head_state, h, mask=emask)


@triton.jit
def _chunk_scan_kernel(x_ptr, B_ptr, C_ptr, CB_ptr, dt_out_ptr, cs_ptr, states_ptr, seq_ptr, D_ptr, z_ptr, out_ptr,
                       out_x_ptr, seqlen, nheads, headdim, ngroups, dstate, nchunks, CHUNK: tl.constexpr,
                       HAS_SEQ: tl.constexpr, HAS_D: tl.constexpr, D_PER_DIM: tl.constexpr, HAS_Z: tl.constexpr,
                       DOT_PRECISION: tl.constexpr, SPLIT_SCORES: tl.constexpr, RECOMPUTE_CB: tl.constexpr,
                       HEADS_FIRST: tl.constexpr, M_LOOP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (tile, batch*chunk, head), or (head, tile, batch*chunk) with HEADS_FIRST. A tile is
    BLOCK_M tokens x BLOCK_P of headdim; with M_LOOP it is BLOCK_P of headdim and the program walks
    the chunk's token tiles, loading the entering state once (not once per token tile).

    RECOMPUTE_CB: each [t, s] block of C.B is recomputed by a matmul from the C tile in registers,
    as attention does with Q K^T, instead of loading stage 2's fp32 CB. RECOMPUTE_CB and M_LOOP need
    BLOCK_N >= dstate (one dstate tile). Scalar 64-bit bases, 32-bit offsets inside the chunk (the
    launcher checks they fit)."""
    if HEADS_FIRST:
        pid_h, pid_tile, pid_bc = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    else:
        pid_tile, pid_bc, pid_h = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    pid_b, pid_c = pid_bc // nchunks, pid_bc % nchunks
    chunk_len = tl.minimum(seqlen - pid_c * CHUNK, CHUNK)  # tokens of this chunk before the end
    if M_LOOP:
        p = pid_tile * BLOCK_P + tl.arange(0, BLOCK_P)
        m_first, m_end = 0, chunk_len
    else:
        tiles_p = tl.cdiv(headdim, BLOCK_P)
        p = (pid_tile % tiles_p) * BLOCK_P + tl.arange(0, BLOCK_P)
        m_first = (pid_tile // tiles_p) * BLOCK_M
        m_end = m_first + 1
    pmask = p < headdim
    group = pid_h // (nheads // ngroups)
    first_row = (pid_b * seqlen).to(tl.int64) + pid_c * CHUNK
    x_stride = nheads * headdim
    bc_stride = ngroups * dstate
    x_base = x_ptr + first_row * x_stride + pid_h * headdim
    C_base = C_ptr + first_row * bc_stride + group * dstate
    B_base = B_ptr + first_row * bc_stride + group * dstate
    chunk_row = ((pid_b * nheads + pid_h).to(tl.int64) * nchunks + pid_c) * CHUNK
    cb_base = CB_ptr + ((pid_b * nchunks + pid_c).to(tl.int64) * ngroups + group) * CHUNK * CHUNK
    st_base = states_ptr + (((pid_b * nchunks + pid_c).to(tl.int64) * nheads + pid_h) * headdim) * dstate
    out_base = first_row * x_stride + pid_h * headdim
    if HAS_SEQ:
        seq_row = seq_ptr + first_row
        seg_prev = tl.load(seq_row + tl.maximum(-1, -pid_c * CHUNK))  # the token before the chunk (or token 0)
    mm_dtype = x_ptr.dtype.element_ty  # the products run in x's dtype, whatever C's is
    if RECOMPUTE_CB or M_LOOP:  # one dstate tile: the entering state [n, p], once per program
        n = tl.arange(0, BLOCK_N)
        nmask = n < dstate
        st = tl.load(st_base + p[None, :] * dstate + n[:, None], mask=nmask[:, None] & pmask[None, :],
                     other=0.0).to(mm_dtype)
    if HAS_D:
        if D_PER_DIM:
            d = tl.load(D_ptr + pid_h * headdim + p, mask=pmask, other=0.0).to(tl.float32)[None, :]
        else:
            d = tl.load(D_ptr + pid_h).to(tl.float32)

    for m_start in range(m_first, m_end, BLOCK_M):
        t = m_start + tl.arange(0, BLOCK_M)
        tmask = t < chunk_len
        cs_t = tl.load(cs_ptr + chunk_row + t)
        if HAS_SEQ:
            seg_t = tl.load(seq_row + t, mask=tmask, other=-1)
        # inter-chunk: exp(cs_t) C_t . state_in[p, :]
        acc = tl.zeros([BLOCK_M, BLOCK_P], dtype=tl.float32)
        if RECOMPUTE_CB or M_LOOP:  # c stays for the intra-chunk products when RECOMPUTE_CB
            c = tl.load(C_base + t[:, None] * bc_stride + n[None, :],
                        mask=tmask[:, None] & nmask[None, :], other=0.0).to(mm_dtype)  # [t, n]
            acc = tl.dot(dot_operand(c), dot_operand(st), acc, input_precision=DOT_PRECISION)
        else:
            for n0 in range(0, dstate, BLOCK_N):
                nn = n0 + tl.arange(0, BLOCK_N)
                c_n = tl.load(C_base + t[:, None] * bc_stride + nn[None, :],
                              mask=tmask[:, None] & (nn < dstate)[None, :], other=0.0).to(mm_dtype)
                st_n = tl.load(st_base + p[None, :] * dstate + nn[:, None],
                               mask=(nn < dstate)[:, None] & pmask[None, :], other=0.0)
                acc = tl.dot(dot_operand(c_n), dot_operand(st_n.to(mm_dtype)), acc,
                             input_precision=DOT_PRECISION)
        from_start = cs_t
        if HAS_SEQ:
            from_start = tl.where(seg_t == seg_prev, cs_t, float("-inf"))
        acc *= tl.exp(from_start)[:, None]

        # intra-chunk: sum_{s <= t, same run} CB[t, s] exp(cs_t - cs_s) dt_s x_s
        for s0 in range(0, m_start + BLOCK_M, BLOCK_K):
            s = s0 + tl.arange(0, BLOCK_K)
            smask = s < chunk_len
            cs_s = tl.load(cs_ptr + chunk_row + s)
            dt_s = tl.load(dt_out_ptr + chunk_row + s)
            if RECOMPUTE_CB:
                bt = tl.load(B_base + s[None, :] * bc_stride + n[:, None],
                             mask=nmask[:, None] & smask[None, :], other=0.0).to(mm_dtype)  # [n, s]
                cb = tl.dot(dot_operand(c), dot_operand(bt), input_precision=DOT_PRECISION)
            else:
                cb = tl.load(cb_base + t[:, None] * CHUNK + s[None, :])
            keep = s[None, :] <= t[:, None]
            if HAS_SEQ:
                seg_s = tl.load(seq_row + s, mask=smask, other=-2)
                keep = keep & (seg_s[None, :] == seg_t[:, None])
            # masked before exp: above the diagonal cs_t - cs_s > 0 may overflow
            scores = cb * tl.exp(tl.where(keep, cs_t[:, None] - cs_s[None, :], float("-inf"))) * dt_s[None, :]
            if HAS_D and not D_PER_DIM:  # D x_t rides on the diagonal of the weights: x is not read again
                scores += tl.where(s[None, :] == t[:, None], d, 0.0)
            xs = tl.load(x_base + s[:, None] * x_stride + p[None, :], mask=smask[:, None] & pmask[None, :],
                         other=0.0)                                                        # [s, p]
            scores_hi = scores.to(xs.dtype)
            acc = tl.dot(dot_operand(scores_hi), dot_operand(xs), acc, input_precision=DOT_PRECISION)
            if SPLIT_SCORES:  # a second bf16 term carries what the first rounded off (8 more bits)
                scores_lo = (scores - scores_hi.to(tl.float32)).to(xs.dtype)
                acc = tl.dot(dot_operand(scores_lo), dot_operand(xs), acc, input_precision=DOT_PRECISION)

        tile = t[:, None] * x_stride + p[None, :]
        tile_mask = tmask[:, None] & pmask[None, :]
        if D_PER_DIM:
            acc += d * tl.load(x_base + tile, mask=tile_mask, other=0.0).to(tl.float32)
        if HAS_Z:
            tl.store(out_x_ptr + out_base + tile, acc.to(out_x_ptr.dtype.element_ty), mask=tile_mask)
            zt = tl.load(z_ptr + out_base + tile, mask=tile_mask, other=0.0).to(tl.float32)
            acc *= zt / (1.0 + tl.exp(-zt))
        tl.store(out_ptr + out_base + tile, acc.to(out_ptr.dtype.element_ty), mask=tile_mask)


# ----------------------------------------------------------------------------------------------------
# autotuned variants of stages 3/4 and 5 for large GPU problems (configs: ssd_tuning.py); the
# interpreter and small problems use SSDConfig's tiles

def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(int(n)))


def _fit_configs(configs, limits, keep=lambda kw: True):
    """The configs with their tiles clipped to ``limits`` (name -> largest useful value, in order, so
    a later limit may name an earlier tile), those ``keep`` accepts, without duplicates."""
    fitted, seen = [], set()
    for c in configs:
        kw = dict(c.kwargs)
        for name, limit in limits.items():
            kw[name] = min(kw[name], kw[limit] if isinstance(limit, str) else limit)
        key = (tuple(sorted(kw.items())), c.num_warps, c.num_stages)
        if keep(kw) and key not in seen:
            seen.add(key)
            fitted.append(triton.Config(kw, num_warps=c.num_warps, num_stages=c.num_stages))
    return fitted


def _prune_scan_configs(configs, named_args, **kwargs):
    """Tiles clipped to the problem; the one-dstate-tile variants only where dstate allows them (the
    launcher passes BLOCK_N: all of dstate there, 64 otherwise)."""
    one_tile = named_args["dstate"] <= _ONE_DSTATE_TILE_MAX
    return _fit_configs(configs, {"BLOCK_M": kwargs["CHUNK"], "BLOCK_K": "BLOCK_M",
                                  "BLOCK_P": _pow2_at_least_16(named_args["headdim"])},
                        lambda kw: one_tile or not (kw["RECOMPUTE_CB"] or kw["M_LOOP"]))


def _prune_tile_configs(configs, named_args, **kwargs):
    return _fit_configs(configs, {"BLOCK_K": kwargs["CHUNK"], "BLOCK_P": _pow2_at_least_16(named_args["headdim"]),
                                  "BLOCK_N": _pow2_at_least_16(named_args["dstate"])})


_chunk_scan_tuned = triton.autotune(SCAN_CONFIGS, key=["CHUNK", "headdim", "dstate", "ngroups", "HAS_SEQ", "HAS_Z"],
                                    prune_configs_by={"early_config_prune": _prune_scan_configs})(_chunk_scan_kernel)
_chunk_state_tuned = triton.autotune(STATE_CONFIGS, key=["CHUNK", "headdim", "dstate", "ngroups", "HAS_SEQ"],
                                     prune_configs_by={"early_config_prune": _prune_tile_configs})(_chunk_state_kernel)
_fused_states_tuned = triton.autotune(FUSED_CONFIGS, key=["CHUNK", "headdim", "dstate", "ngroups", "HAS_SEQ",
                                                           "HAS_INIT"],
                                      prune_configs_by={"early_config_prune": _prune_tile_configs})(
    _fused_state_passing_kernel)


def tuned_configs():
    """The configs the autotuner chose so far, per kernel (for the benchmark's record)."""
    return {name: {str(key): str(cfg) for key, cfg in kernel.cache.items()}
            for name, kernel in (("chunk_scan", _chunk_scan_tuned), ("chunk_state", _chunk_state_tuned),
                                 ("fused_states", _fused_states_tuned))}


# ----------------------------------------------------------------------------------------------------
# launchers

class _Dims(NamedTuple):
    batch: int
    seqlen: int
    nheads: int
    headdim: int
    ngroups: int
    dstate: int
    chunk: int
    nchunks: int


def nchunks_of(seqlen: int, chunk_size: int) -> int:
    return max(1, -(-int(seqlen) // int(chunk_size)))


def check_chunk_size(chunk_size) -> int:
    """The chunk sizes the kernels take: a power of two, >= 16 on the GPU (tl.dot tiles), >= 1 in the
    interpreter."""
    low = 1 if INTERPRETING else 16
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < low \
            or chunk_size & (chunk_size - 1):
        raise ValueError(f"chunk_size: the Triton SSD kernels need a power of two >= {low}, got {chunk_size!r}")
    return chunk_size


def _expect(name, t, dims, dtypes=None):
    if t is None:
        return
    T.check_same_shape(name, t, dims)
    T.check_contiguous(name, t)
    if dtypes is not None and T.dtype_name(t) not in dtypes:
        raise TypeError(f"{name}: expected dtype in {list(dtypes)}, got {T.dtype_name(t)}")


def _dims(x, B, chunk_size) -> _Dims:
    if len(T.shape(x)) != 4:
        raise ValueError(f"x: expected [batch, seqlen, nheads, headdim], got shape {T.shape(x)}")
    batch, seqlen, nheads, headdim = T.shape(x)
    if len(T.shape(B)) != 4 or T.shape(B)[:2] != (batch, seqlen) or T.shape(B)[2] < 1 \
            or nheads % T.shape(B)[2]:
        raise ValueError(f"B: expected [batch={batch}, seqlen={seqlen}, ngroups dividing nheads={nheads}, dstate], "
                         f"got {T.shape(B)}")
    if seqlen < 1:
        raise ValueError(f"x: expected seqlen >= 1, got {seqlen}")
    chunk = check_chunk_size(chunk_size)
    ngroups, dstate = T.shape(B)[2:]
    if chunk * max(nheads * headdim, ngroups * dstate) >= 2**31:  # 32-bit offsets inside a chunk
        raise ValueError(f"chunk_size: chunk_size * nheads * headdim and chunk_size * ngroups * dstate must stay "
                         f"below 2^31, got chunk_size={chunk}, x {T.shape(x)}, B {T.shape(B)}")
    return _Dims(batch, seqlen, nheads, headdim, ngroups, dstate, chunk, nchunks_of(seqlen, chunk))


def buffer_shapes(batch, seqlen, nheads, headdim, ngroups, dstate, chunk_size):
    """Shapes of the fp32 buffers the forward writes (and the backward reads)."""
    nchunks = nchunks_of(seqlen, chunk_size)
    return {"dt_out": (batch, nheads, nchunks, chunk_size), "dA_cumsum": (batch, nheads, nchunks, chunk_size),
            "states": (batch, nchunks, nheads, headdim, dstate),
            "CB": (batch, nchunks, ngroups, chunk_size, chunk_size), "final_states": (batch, nheads, headdim, dstate)}


def _tile(block: int, size: int, low: int) -> int:
    """A power-of-two tile no larger than needed for ``size`` and no smaller than ``low``
    (tl.dot needs 16 when compiled); the interpreter caps it at ``_INTERPRETER_TILE`` and has no floor."""
    if INTERPRETING:
        return min(block, _INTERPRETER_TILE, triton.next_power_of_2(size))
    return max(low, min(block, triton.next_power_of_2(size)))


def _dot_precision(x) -> str:
    return "ieee" if T.dtype_name(x) == "float32" else "tf32"  # (ignored for 16-bit operands)


def ssd_chunk_cumsum(dt, A, dt_out, dA_cumsum, *, chunk_size, dt_bias=None, dt_softplus=False,
                     dt_limit=(0.0, math.inf), config: SSDConfig = DEFAULT_CONFIG) -> None:
    """Stage 1: dt [b, l, h] -> dt_out, dA_cumsum [b, h, c, K] (fp32)."""
    if len(T.shape(dt)) != 3:
        raise ValueError(f"dt: expected [batch, seqlen, nheads], got shape {T.shape(dt)}")
    batch, seqlen, nheads = T.shape(dt)
    chunk = check_chunk_size(chunk_size)
    nchunks = nchunks_of(seqlen, chunk)
    _expect("dt", dt, (batch, seqlen, nheads))
    _expect("A", A, (nheads,))
    _expect("dt_bias", dt_bias, (nheads,))
    for name, t in (("dt_out", dt_out), ("dA_cumsum", dA_cumsum)):
        _expect(name, t, (batch, nheads, nchunks, chunk), ("float32",))
    lo, hi = (float(v) for v in dt_limit)
    block_h = _tile(config.cumsum_block_h, nheads, 1)
    block_t = chunk if INTERPRETING else min(chunk, max(1, 2048 // block_h))
    grid = (batch, nchunks, triton.cdiv(nheads, block_h))
    _chunk_cumsum_kernel[grid](dt, A, dt_bias, dt_out, dA_cumsum, seqlen, nheads, nchunks, lo,
                               hi if math.isfinite(hi) else 3.0e38, CHUNK=chunk, HAS_BIAS=dt_bias is not None,
                               DT_SOFTPLUS=bool(dt_softplus), HAS_LIMIT=lo > 0.0 or math.isfinite(hi),
                               BLOCK_T=block_t, BLOCK_H=block_h, num_warps=4)


def ssd_chunk_cb(C, B, CB, *, chunk_size, config: SSDConfig = DEFAULT_CONFIG) -> None:
    """Stage 2: CB [b, c, g, K, K] = C_t . B_s within each chunk (fp32)."""
    d = _dims_bc(B, chunk_size)
    _expect("B", B, (d.batch, d.seqlen, d.ngroups, d.dstate))
    _expect("C", C, (d.batch, d.seqlen, d.ngroups, d.dstate))
    _expect("CB", CB, (d.batch, d.nchunks, d.ngroups, d.chunk, d.chunk), ("float32",))
    block = min(_tile(config.cb_block, d.chunk, 16), d.chunk)
    block_n = _tile(64, d.dstate, 16)
    grid = ((d.chunk // block) ** 2, d.batch * d.nchunks, d.ngroups)
    _chunk_cb_kernel[grid](C, B, CB, d.seqlen, d.nchunks, d.ngroups, d.dstate, CHUNK=d.chunk,
                           DOT_PRECISION=_dot_precision(B), BLOCK_M=block, BLOCK_S=block, BLOCK_N=block_n,
                           num_warps=4)


def _dims_bc(B, chunk_size):
    if len(T.shape(B)) != 4:
        raise ValueError(f"B: expected [batch, seqlen, ngroups, dstate], got shape {T.shape(B)}")
    batch, seqlen, ngroups, dstate = T.shape(B)
    chunk = check_chunk_size(chunk_size)
    return _Dims(batch, seqlen, 0, 0, ngroups, dstate, chunk, nchunks_of(seqlen, chunk))


def _tuned(config, d: _Dims, x) -> bool:
    """The autotuned kernels: no explicit config, a big problem, 16-bit inputs (fp32 runs 32-wide tiles)."""
    return config is None and not INTERPRETING and d.batch * d.nchunks * d.nheads >= TUNE_MIN_PROGRAMS \
        and T.dtype_name(x) != "float32"


def _launch_chunk_state(x, B, dt_out, dA_cumsum, seq_idx, states, final_states, positions, states_at, d: _Dims,
                        config: Optional[SSDConfig]):
    ncols = d.nchunks if positions is None else T.shape(positions)[0]
    if positions is None and _tuned(config, d, x):
        grid = lambda meta: (triton.cdiv(d.headdim, meta["BLOCK_P"]) * triton.cdiv(d.dstate, meta["BLOCK_N"]),  # noqa
                             d.batch * ncols, d.nheads)
        _chunk_state_tuned[grid](x, B, dt_out, dA_cumsum, seq_idx, states, final_states, None, None, d.seqlen,
                                 d.nheads, d.headdim, d.ngroups, d.dstate, d.nchunks, ncols, CHUNK=d.chunk,
                                 HAS_SEQ=seq_idx is not None, AT_POSITIONS=False, DOT_PRECISION=_dot_precision(x))
        return
    config = config or DEFAULT_CONFIG
    block_p = _tile(config.state_block_p, d.headdim, 16)
    block_n = _tile(config.state_block_n, d.dstate, 16)
    block_k = min(_tile(config.state_block_k, d.chunk, 16), d.chunk)
    grid = (triton.cdiv(d.headdim, block_p) * triton.cdiv(d.dstate, block_n), d.batch * ncols, d.nheads)
    _chunk_state_kernel[grid](x, B, dt_out, dA_cumsum, seq_idx, states, final_states, positions, states_at,
                              d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate, d.nchunks, ncols, CHUNK=d.chunk,
                              HAS_SEQ=seq_idx is not None, AT_POSITIONS=positions is not None,
                              DOT_PRECISION=_dot_precision(x), BLOCK_P=block_p, BLOCK_N=block_n, BLOCK_K=block_k,
                              num_warps=config.state_warps, num_stages=config.state_stages)


def _check_common(x, dt, A, B, C, dt_out, dA_cumsum, states, seq_idx, chunk_size):
    d = _dims(x, B, chunk_size)
    _expect("x", x, (d.batch, d.seqlen, d.nheads, d.headdim))
    _expect("dt", dt, (d.batch, d.seqlen, d.nheads))
    _expect("A", A, (d.nheads,))
    _expect("B", B, (d.batch, d.seqlen, d.ngroups, d.dstate))
    _expect("C", C, (d.batch, d.seqlen, d.ngroups, d.dstate))
    if C is not None and T.dtype_name(C) != T.dtype_name(B):
        raise TypeError(f"C: expected B's dtype {T.dtype_name(B)}, got {T.dtype_name(C)}")
    _expect("seq_idx", seq_idx, (d.batch, d.seqlen), ("int32", "int64"))
    shapes = buffer_shapes(d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate, d.chunk)
    for name, t in (("dt_out", dt_out), ("dA_cumsum", dA_cumsum)):
        _expect(name, t, shapes[name], ("float32",))
    _expect("states", states, shapes["states"], ("float32", T.dtype_name(x)))
    return d


def ssd_chunked_fwd(x, dt, A, B, C, out, dt_out, dA_cumsum, states, CB, final_states, *, chunk_size, D=None, z=None,
                    out_x=None, dt_bias=None, initial_states=None, seq_idx=None, dt_softplus=False,
                    dt_limit=(0.0, math.inf), config: Optional[SSDConfig] = None) -> None:
    """The whole forward (stages 1-5), writing out [b, l, h, p] (x's dtype), out_x (with z: y before
    the gate), and the fp32 buffers dt_out, dA_cumsum, CB, final_states (shapes from ``buffer_shapes``)
    and states (float32, or x's dtype where ``states_dtype`` allows it). ``seq_idx`` holds run ids (see
    the module docstring)."""
    d = _check_common(x, dt, A, B, C, dt_out, dA_cumsum, states, seq_idx, chunk_size)
    explicit, config = config, config or DEFAULT_CONFIG
    shapes = buffer_shapes(d.batch, d.seqlen, d.nheads, d.headdim, d.ngroups, d.dstate, d.chunk)
    _expect("CB", CB, shapes["CB"], ("float32",))
    _expect("final_states", final_states, shapes["final_states"], ("float32",))
    _expect("initial_states", initial_states, shapes["final_states"])
    x_shape = (d.batch, d.seqlen, d.nheads, d.headdim)
    _expect("out", out, x_shape, (T.dtype_name(x),))
    _expect("z", z, x_shape)
    if (z is None) != (out_x is None):
        raise ValueError("out_x: give it exactly when z is given (y before the gate)")
    _expect("out_x", out_x, x_shape, (T.dtype_name(x),))
    if D is not None and T.shape(D) not in ((d.nheads,), (d.nheads, d.headdim)):
        raise ValueError(f"D: expected [nheads={d.nheads}] or [nheads, headdim={d.headdim}], got {T.shape(D)}")
    _expect("D", D, T.shape(D) if D is not None else None)
    if T.dtype_name(states) not in ("float32", states_dtype(T.dtype_name(x), d.batch, d.nheads, config)):
        raise TypeError(f"states: a {T.dtype_name(states)} buffer needs stages 3+4 fused (the unfused state passing "
                        f"sums the stored states): pass float32 (``states_dtype`` says which)")

    ssd_chunk_cumsum(dt, A, dt_out, dA_cumsum, chunk_size=d.chunk, dt_bias=dt_bias, dt_softplus=dt_softplus,
                     dt_limit=dt_limit, config=config)
    ssd_chunk_cb(C, B, CB, chunk_size=d.chunk, config=config)
    if _fuses_state_passing(d.batch, d.nheads, config):
        _launch_fused_states(x, B, dt_out, dA_cumsum, seq_idx, initial_states, states, final_states, d, explicit)
    else:
        _launch_chunk_state(x, B, dt_out, dA_cumsum, seq_idx, states, final_states, None, None, d, explicit)
        _launch_state_passing(states, final_states, initial_states, dA_cumsum, seq_idx, d, config)
    _launch_chunk_scan(x, B, C, CB, dt_out, dA_cumsum, states, seq_idx, D, z, out, out_x, d, explicit)


def _fuses_state_passing(batch: int, nheads: int, config: SSDConfig) -> bool:
    if config.fuse_state_passing is None:
        return not INTERPRETING and batch * nheads >= FUSED_MIN_ROWS
    return config.fuse_state_passing


def states_dtype(x_dtype: str, batch: int, nheads: int, config: Optional[SSDConfig] = None) -> str:
    """The dtype the forward's ``states`` buffer should have: x's for 16-bit x when stages 3+4 run
    fused, float32 otherwise. Fused, the state is summed in fp32 registers and only stored for its
    readers, whose products (chunk scan, backward) round it to x's dtype anyway: half the bytes
    written and read (a 16-bit buffer also rounds the backward's d cs_end term and ``ssd_states_at``'s
    carried state; ask for float32 there). Unfused, the state passing sums the stored states: float32."""
    if x_dtype in ("float16", "bfloat16") and _fuses_state_passing(batch, nheads, config or DEFAULT_CONFIG):
        return x_dtype
    return "float32"


def _launch_state_passing(states, final_states, initial_states, dA_cumsum, seq_idx, d: _Dims, config: SSDConfig):
    state_size = d.headdim * d.dstate
    block = _tile(config.pass_block, state_size, 1) if not INTERPRETING else triton.next_power_of_2(state_size)
    _state_passing_kernel[(triton.cdiv(state_size, block), d.batch, d.nheads)](
        states, final_states, initial_states, dA_cumsum, seq_idx, d.seqlen, d.nheads, d.nchunks, state_size,
        CHUNK=d.chunk, HAS_INIT=initial_states is not None, HAS_SEQ=seq_idx is not None, BLOCK=block, num_warps=4)


def _launch_fused_states(x, B, dt_out, dA_cumsum, seq_idx, initial_states, states, final_states, d: _Dims,
                         config: Optional[SSDConfig]):
    """Stages 3+4 in one kernel; autotuned when ``config`` is None and the problem is big (``_tuned``)."""
    args = (x, B, dt_out, dA_cumsum, seq_idx, initial_states, states, final_states, d.seqlen, d.nheads, d.headdim,
            d.ngroups, d.dstate, d.nchunks)
    options = dict(CHUNK=d.chunk, HAS_INIT=initial_states is not None, HAS_SEQ=seq_idx is not None,
                   DOT_PRECISION=_dot_precision(x))
    if _tuned(config, d, x):
        tiles = lambda meta: triton.cdiv(d.headdim, meta["BLOCK_P"]) * triton.cdiv(d.dstate, meta["BLOCK_N"])  # noqa
        _fused_states_tuned[lambda meta: (tiles(meta), d.batch, d.nheads)](*args, **options)
        return
    config = config or DEFAULT_CONFIG
    block_p = _tile(config.fused_block_p, d.headdim, 16)
    block_n = _tile(config.fused_block_n, d.dstate, 16)
    grid = (triton.cdiv(d.headdim, block_p) * triton.cdiv(d.dstate, block_n), d.batch, d.nheads)
    _fused_state_passing_kernel[grid](*args, **options, BLOCK_P=block_p, BLOCK_N=block_n,
                                      BLOCK_K=min(_tile(config.fused_block_k, d.chunk, 16), d.chunk),
                                      num_warps=config.fused_warps, num_stages=config.fused_stages)


def _launch_chunk_scan(x, B, C, CB, dt_out, dA_cumsum, states, seq_idx, D, z, out, out_x, d: _Dims,
                       config: Optional[SSDConfig]):
    """Stage 5; autotuned when ``config`` is None and the problem is big (``_tuned``)."""
    args = (x, B, C, CB, dt_out, dA_cumsum, states, seq_idx, D, z, out, out_x, d.seqlen, d.nheads, d.headdim,
            d.ngroups, d.dstate, d.nchunks)
    split = (config or DEFAULT_CONFIG).split_scores and T.dtype_name(x) == "bfloat16"
    options = dict(CHUNK=d.chunk, HAS_SEQ=seq_idx is not None, HAS_D=D is not None,
                   D_PER_DIM=D is not None and len(T.shape(D)) == 2, HAS_Z=z is not None,
                   DOT_PRECISION=_dot_precision(x), SPLIT_SCORES=split)

    def grid_of(block_m, block_p, heads_first, m_loop):
        tiles = (1 if m_loop else d.chunk // block_m) * triton.cdiv(d.headdim, block_p)
        return (d.nheads, tiles, d.batch * d.nchunks) if heads_first else (tiles, d.batch * d.nchunks, d.nheads)

    one_tile = d.dstate <= _ONE_DSTATE_TILE_MAX  # what RECOMPUTE_CB and M_LOOP need
    dstate_tile = triton.next_power_of_2(max(d.dstate, 16))
    if _tuned(config, d, x):
        _chunk_scan_tuned[lambda meta: grid_of(meta["BLOCK_M"], meta["BLOCK_P"], meta["HEADS_FIRST"],
                                               meta["M_LOOP"])](*args, **options,
                                                                BLOCK_N=dstate_tile if one_tile else 64)
        return
    config = config or DEFAULT_CONFIG
    # fp32 operands double the registers and shared memory of a tile: 32-wide token and headdim tiles
    # (the 64-wide ones took ~8 s to compile and gain nothing: fp32 is the accuracy path)
    cap = 32 if T.dtype_name(x) == "float32" else 1 << 30
    block_m = min(_tile(config.scan_block_m, d.chunk, 16), d.chunk, cap)
    block_p = min(_tile(config.scan_block_p, d.headdim, 16), cap)
    block_k = min(_tile(config.scan_block_k, d.chunk, 16), block_m)
    recompute_cb, m_loop = config.recompute_cb and one_tile, config.scan_m_loop and one_tile
    block_n = dstate_tile if recompute_cb or m_loop else _tile(config.scan_block_n, d.dstate, 16)
    _chunk_scan_kernel[grid_of(block_m, block_p, config.scan_heads_first, m_loop)](
        *args, **options, RECOMPUTE_CB=recompute_cb, HEADS_FIRST=config.scan_heads_first, M_LOOP=m_loop,
        BLOCK_M=block_m, BLOCK_P=block_p, BLOCK_K=block_k, BLOCK_N=block_n, num_warps=config.scan_warps,
        num_stages=config.scan_stages)


def ssd_states_at(x, dt, A, B, dt_out, dA_cumsum, states, positions, states_at, *, chunk_size, seq_idx=None,
                  config: Optional[SSDConfig] = None) -> None:
    """states_at [b, npos, h, p, n] (fp32) = the state right after token ``positions[i]`` (int
    [npos], each < seqlen), from the forward's dt_out, dA_cumsum and entering states (float32 ones
    for fp32 accuracy: a 16-bit ``states`` rounds the carried part)."""
    config = config or DEFAULT_CONFIG
    d = _check_common(x, dt, A, B, None, dt_out, dA_cumsum, states, seq_idx, chunk_size)
    if len(T.shape(positions)) != 1:
        raise ValueError(f"positions: expected [npos], got shape {T.shape(positions)}")
    _expect("positions", positions, T.shape(positions), ("int32", "int64"))
    _expect("states_at", states_at, (d.batch, T.shape(positions)[0], d.nheads, d.headdim, d.dstate), ("float32",))
    if T.shape(positions)[0]:
        _launch_chunk_state(x, B, dt_out, dA_cumsum, seq_idx, states, None, positions, states_at, d, config)


def compile_cases():
    """The canonical bf16 case (D; autotuned, stages 3+4 fused, bf16 states) and fp16/fp32 at a quarter
    of it (fixed tiles), z + D [h, p] + seq_idx + initial states + limits at an odd shape; in bf16 also
    the fixed-tile fused stages 3+4 and the other chunk-scan variants; the positions kernel."""
    S = T.SpecTensor
    for dtype, (batch, seqlen, nheads, headdim, ngroups, dstate, chunk), extras in (
            ("bfloat16", (4, 4096, 64, 128, 1, 128, 256), False),  # autotuned: every config
            ("float16", (1, 1024, 64, 128, 1, 128, 256), False),   # below TUNE_MIN_PROGRAMS: SSDConfig's tiles
            ("float32", (1, 1024, 64, 128, 1, 128, 256), False),
            ("bfloat16", (2, 1000, 6, 40, 3, 24, 64), True)):
        x, out = S((batch, seqlen, nheads, headdim), dtype), S((batch, seqlen, nheads, headdim), dtype)
        dt, A = S((batch, seqlen, nheads), dtype), S((nheads,), "float32")
        B, C = S((batch, seqlen, ngroups, dstate), dtype), S((batch, seqlen, ngroups, dstate), dtype)
        shapes = buffer_shapes(batch, seqlen, nheads, headdim, ngroups, dstate, chunk)
        buf = {k: S(v, "float32") for k, v in shapes.items()}
        kw = dict(chunk_size=chunk, D=S((nheads,), "float32"))
        if extras:
            kw.update(D=S((nheads, headdim), "float32"), z=S(x.shape, dtype), out_x=S(x.shape, dtype),
                      dt_bias=S((nheads,), "float32"), initial_states=S(buf["final_states"].shape, "float32"),
                      seq_idx=S((batch, seqlen), "int32"), dt_softplus=True, dt_limit=(0.01, 10.0))
        label = "extras" if extras else "canonical"
        variants = [("", None)]
        if dtype == "bfloat16":
            variants += [(",fused", SSDConfig(fuse_state_passing=True)),
                         (",apart,recompute_cb,split", SSDConfig(fuse_state_passing=False, recompute_cb=True,
                                                                 scan_m_loop=False, split_scores=True))]
        for variant, config in variants:
            states = S(shapes["states"], states_dtype(dtype, batch, nheads, config))
            args = (x, dt, A, B, C, out, buf["dt_out"], buf["dA_cumsum"], states, buf["CB"], buf["final_states"])
            yield f"ssd_chunked_fwd[{dtype},{label}{variant}]", \
                lambda a=args, k=kw, c=config: ssd_chunked_fwd(*a, **k, config=c)
        if extras:
            pos, at = S((5,), "int64"), S((batch, 5, nheads, headdim, dstate), "float32")
            yield f"ssd_states_at[{dtype}]", lambda a=args, st=buf["states"], p=pos, s=at, q=kw["seq_idx"]: \
                ssd_states_at(a[0], a[1], a[2], a[3], a[6], a[7], st, p, s, chunk_size=chunk, seq_idx=q)
