"""Mamba-1 selective scan: forward and backward (recompute); the decoding step is in ``state_update.py``.

Shapes (``b`` batch, ``d`` dim, ``n`` dstate, ``l`` seqlen, ``g`` groups):
    u, delta, z, out, du, ddelta, dz     [b, d, l]   any strides (contiguous along l is fastest)
    A                                     [d, n]      real
    B, C                                  [d, n] (fixed), [b, n, l] or [b, g, n, l] (input-dependent;
                                          dim d reads group d // (dim / g))
    D, delta_bias                         [d]
    states (saved for backward)           [b, n_chunks, n, d] float32: the state at each chunk's end
    last_state                            [b, d, n]

Recurrence, per (b, d, n) and time t, in fp32:
    dt_t = softplus(delta_t + delta_bias)         (softplus optional, threshold 20 as torch/paddle)
    h_t  = exp(dt_t A) h_{t-1} + dt_t B_t u_t,    h_{-1} = 0
    y_t  = sum_n C_t h_t + D u_t;   out_t = y_t * silu(z_t) when z is given.

One program per (batch, block of dims) walks seqlen in chunks of ``CHUNK`` steps. Each chunk loads
u/delta/z/B/C tiles coalesced along seqlen, runs ``tl.associative_scan`` over the chunk on the
``[BLOCK_D, BLOCK_N, CHUNK]`` pairs ``(exp(dt A), dt B u)`` and folds in the state carried from the
previous chunk, which stays in registers. The forward stores the state at every chunk end
(``states``, fp32); the backward walks the chunks in reverse, recomputes the chunk's states from the
saved start state, and runs the adjoint recurrence ``g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}`` as a
reverse associative scan carrying ``g`` between chunks. Gradients that sum over programs (dA, dD,
ddelta_bias, fixed dB/dC; input-dependent dB/dC over the dims of a group) are accumulated with fp32
atomics into zero-initialised buffers that the caller provides.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import triton
import triton.language as tl

from ...runtime import tensor as T

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _combine(a_first, b_first, a_second, b_second):
    """Compose h -> a_first h + b_first, then h -> a_second h + b_second."""
    return a_first * a_second, b_first * a_second + b_second


@triton.jit
def _softplus(x):
    # torch/paddle softplus with threshold 20; exp overflow above it is discarded by the where
    return tl.where(x <= 20.0, tl.log(1.0 + tl.exp(x)), x)


@triton.jit
def _load_dt(delta_ptrs, mask, bias, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr):
    """(dt, delta + bias) for a [CHUNK, BLOCK_D] tile; dt is 0 outside ``mask`` so that padded steps
    and dims neither decay nor feed the state."""
    raw = tl.load(delta_ptrs, mask=mask, other=0.0).to(tl.float32)
    if HAS_DELTA_BIAS:
        raw += bias[None, :]
    dt = _softplus(raw) if DELTA_SOFTPLUS else raw
    return tl.where(mask, dt, 0.0), raw


@triton.jit
def _load_bc(ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_b, s_g, s_d, s_n, s_l,
             VARIABLE: tl.constexpr):
    """B or C broadcastable against [CHUNK, BLOCK_N, BLOCK_D]: [CHUNK, BLOCK_N, 1] when
    input-dependent ([b, g, n, l]), [1, BLOCK_N, BLOCK_D] when fixed ([d, n])."""
    if VARIABLE:
        tile = tl.load(ptr + b64 * s_b + group * s_g + t64[:, None] * s_l + n[None, :] * s_n,
                       mask=mask_t[:, None] & mask_n[None, :], other=0.0).to(tl.float32)[:, :, None]
    else:
        tile = tl.load(ptr + n[:, None] * s_n + d64[None, :] * s_d,
                       mask=mask_n[:, None] & mask_d[None, :], other=0.0).to(tl.float32)[None, :, :]
    return tile


@triton.jit
def _step(x, steps, which):
    """x[which] of a [CHUNK, BLOCK_N, BLOCK_D] tile as [BLOCK_N, BLOCK_D] (an in-thread select when
    the chunk axis is held by each thread)."""
    return tl.sum(tl.where((steps == which)[:, None, None], x, 0.0), axis=0)


# Tiles are [CHUNK, BLOCK_N, BLOCK_D]: Triton's default layout gives the lanes to the last axis, so
# dims go across lanes and each thread holds whole chunks of steps (and most states). The scan over
# steps and the sums over states then run inside a thread; only the backward's sums over dims
# (input-dependent dB/dC) cross lanes. The adjoint's reverse scan is a forward scan of flipped tiles:
# Triton lowers ``reverse=True`` with warp shuffles even along an in-thread axis, a flip is free.


@triton.jit
def _chunk_states(h, c, u_col, dt_col, B_ptr, b64, group, d64, n, steps, mask_d, mask_n, seqlen, A2, bias,
                  s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l,
                  HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr, B_VARIABLE: tl.constexpr,
                  CHUNK: tl.constexpr):
    """The states of chunk c ([CHUNK, BLOCK_N, BLOCK_D]) from the state h before it, with what the
    backward reuses: (hs, u, dt, delta + bias, B, dt B u, mask [CHUNK, BLOCK_D], steps as int64)."""
    t = c * CHUNK + steps
    t64 = t.to(tl.int64)
    mask_t = t < seqlen
    mask = mask_t[:, None] & mask_d[None, :]
    u = tl.load(u_col + t64[:, None] * s_u_l, mask=mask, other=0.0).to(tl.float32)
    dt, raw = _load_dt(dt_col + t64[:, None] * s_dt_l, mask, bias, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
    Bt = _load_bc(B_ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l,
                  B_VARIABLE)
    dBu = (dt * u)[:, None, :] * Bt
    a_cum, h_local = tl.associative_scan((tl.exp2(dt[:, None, :] * A2[None, :, :]), dBu), axis=0,
                                         combine_fn=_combine)
    return a_cum * h[None, :, :] + h_local, u, dt, raw, Bt, dBu, mask, t64


@triton.jit
def _selective_scan_fwd_kernel(
        u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, out_ptr, states_ptr, last_ptr,
        dim, seqlen, dstate, dim_per_group, num_chunks, seg_chunks,
        s_u_b, s_u_d, s_u_l, s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n,
        s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, s_C_b, s_C_g, s_C_d, s_C_n, s_C_l,
        s_z_b, s_z_d, s_z_l, s_o_b, s_o_d, s_o_l, s_st_b, s_st_s, s_st_n, s_last_b, s_last_d,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr,
        B_VARIABLE: tl.constexpr, C_VARIABLE: tl.constexpr, STORE_STATES: tl.constexpr,
        STORE_LAST: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    pid_d = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    n = tl.arange(0, BLOCK_N)
    mask_n = n < dstate
    steps = tl.arange(0, CHUNK)
    group = (pid_d * BLOCK_D) // dim_per_group  # the launcher keeps a block inside one group
    mask_nd = mask_n[:, None] & mask_d[None, :]

    A2 = tl.load(A_ptr + n[:, None] * s_A_n + d64[None, :] * s_A_d, mask=mask_nd, other=0.0).to(tl.float32)
    A2 = A2 * _LOG2E
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = None
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    u_col = u_ptr + b64 * s_u_b + d64[None, :] * s_u_d
    dt_col = delta_ptr + b64 * s_dt_b + d64[None, :] * s_dt_d
    o_col = out_ptr + b64 * s_o_b + d64[None, :] * s_o_d

    h = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for c in range(num_chunks):
        hs, u, dt, raw, Bt, dBu, mask, t64 = _chunk_states(
            h, c, u_col, dt_col, B_ptr, b64, group, d64, n, steps, mask_d, mask_n, seqlen, A2, bias,
            s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, HAS_DELTA_BIAS, DELTA_SOFTPLUS, B_VARIABLE, CHUNK)
        Ct = _load_bc(C_ptr, b64, group, d64, n, t64, mask_d, mask_n, c * CHUNK + steps < seqlen,
                      s_C_b, s_C_g, s_C_d, s_C_n, s_C_l, C_VARIABLE)
        y = tl.sum(hs * Ct, axis=1)
        if HAS_D:
            y += Dv[None, :] * u
        if HAS_Z:
            zv = tl.load(z_ptr + b64 * s_z_b + d64[None, :] * s_z_d + t64[:, None] * s_z_l, mask=mask, other=0.0)
            zv = zv.to(tl.float32)
            y = y * zv * tl.sigmoid(zv)
        tl.store(o_col + t64[:, None] * s_o_l, y.to(out_ptr.dtype.element_ty), mask=mask)
        h = _step(hs, steps, CHUNK - 1)  # padded steps keep the state (dt = 0)
        if STORE_STATES:  # the state at each segment's end (the backward's restart points)
            seg_end = ((c + 1) % seg_chunks == 0) | (c == num_chunks - 1)
            tl.store(states_ptr + b64 * s_st_b + (c // seg_chunks) * s_st_s + n[:, None] * s_st_n + d64[None, :],
                     h, mask=mask_nd & seg_end)
    if STORE_LAST:
        tl.store(last_ptr + b64 * s_last_b + n[:, None] + d64[None, :] * s_last_d,
                 h.to(last_ptr.dtype.element_ty), mask=mask_nd)


@triton.jit
def _selective_scan_bwd_kernel(
        u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, dout_ptr, states_ptr, work_ptr,
        du_ptr, ddelta_ptr, dA_ptr, dB_ptr, dC_ptr, dD_ptr, dz_ptr, ddelta_bias_ptr, out_z_ptr,
        dim, seqlen, dstate, dim_per_group, num_segments, seg_chunks,
        s_u_b, s_u_d, s_u_l, s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n,
        s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, s_C_b, s_C_g, s_C_d, s_C_n, s_C_l,
        s_z_b, s_z_d, s_z_l, s_do_b, s_do_d, s_do_l, s_st_b, s_st_s, s_st_n, s_w_b, s_w_k, s_w_n,
        s_du_b, s_du_d, s_du_l, s_ddt_b, s_ddt_d, s_ddt_l, s_dz_b, s_dz_d, s_dz_l, s_oz_b, s_oz_d, s_oz_l,
        s_dB_b, s_dB_g, s_dB_d, s_dB_n, s_dB_l, s_dC_b, s_dC_g, s_dC_d, s_dC_n, s_dC_l,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr,
        B_VARIABLE: tl.constexpr, C_VARIABLE: tl.constexpr, STORE_OUT_Z: tl.constexpr,
        BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr):
    pid_d = tl.program_id(0)
    b64 = tl.program_id(1).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    d64 = d.to(tl.int64)
    mask_d = d < dim
    n = tl.arange(0, BLOCK_N)
    mask_n = n < dstate
    steps = tl.arange(0, CHUNK)
    group = (pid_d * BLOCK_D) // dim_per_group
    mask_nd = mask_n[:, None] & mask_d[None, :]

    A = tl.load(A_ptr + n[:, None] * s_A_n + d64[None, :] * s_A_d, mask=mask_nd, other=0.0).to(tl.float32)
    A2 = A * _LOG2E
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = None
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    u_col = u_ptr + b64 * s_u_b + d64[None, :] * s_u_d
    dt_col = delta_ptr + b64 * s_dt_b + d64[None, :] * s_dt_d
    do_col = dout_ptr + b64 * s_do_b + d64[None, :] * s_do_d
    st_nd = states_ptr + b64 * s_st_b + n[:, None] * s_st_n + d64[None, :]
    work_nd = work_ptr + b64 * s_w_b + n[:, None] * s_w_n + d64[None, :]

    g_next = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)  # adjoint at the next chunk's first step
    dA_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dB_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dC_acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dD_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    ddb_acc = tl.zeros([BLOCK_D], dtype=tl.float32)
    for si in range(num_segments):
        seg = num_segments - 1 - si
        # pass 1: the segment's chunk-start states, from the state saved at the previous segment's end
        h = tl.load(st_nd + (seg - 1) * s_st_s, mask=mask_nd & (seg > 0), other=0.0)
        for k in range(seg_chunks):
            tl.store(work_nd + k * s_w_k, h, mask=mask_nd)
            hs, _, _, _, _, _, _, _ = _chunk_states(
                h, seg * seg_chunks + k, u_col, dt_col, B_ptr, b64, group, d64, n, steps, mask_d, mask_n, seqlen,
                A2, bias, s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, HAS_DELTA_BIAS, DELTA_SOFTPLUS,
                B_VARIABLE, CHUNK)
            h = _step(hs, steps, CHUNK - 1)
        tl.debug_barrier()  # the workspace rows are read back by other threads
        # pass 2: the segment's chunks in reverse (chunks past the end are fully masked no-ops)
        for kk in range(seg_chunks):
            k = seg_chunks - 1 - kk
            c = seg * seg_chunks + k
            h0 = tl.load(work_nd + k * s_w_k, mask=mask_nd, other=0.0)
            hs, u, dt, raw, Bt, dBu, mask, t64 = _chunk_states(
                h0, c, u_col, dt_col, B_ptr, b64, group, d64, n, steps, mask_d, mask_n, seqlen, A2, bias,
                s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, HAS_DELTA_BIAS, DELTA_SOFTPLUS, B_VARIABLE,
                CHUNK)
            mask_t = c * CHUNK + steps < seqlen
            Ct = _load_bc(C_ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t,
                          s_C_b, s_C_g, s_C_d, s_C_n, s_C_l, C_VARIABLE)
            dout = tl.load(do_col + t64[:, None] * s_do_l, mask=mask, other=0.0).to(tl.float32)
            if HAS_Z:
                y = tl.sum(hs * Ct, axis=1)
                if HAS_D:
                    y += Dv[None, :] * u
                zv = tl.load(z_ptr + b64 * s_z_b + d64[None, :] * s_z_d + t64[:, None] * s_z_l, mask=mask,
                             other=0.0).to(tl.float32)
                sig = tl.sigmoid(zv)
                tl.store(dz_ptr + b64 * s_dz_b + d64[None, :] * s_dz_d + t64[:, None] * s_dz_l,
                         (dout * y * sig * (1.0 + zv * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask)
                if STORE_OUT_Z:
                    tl.store(out_z_ptr + b64 * s_oz_b + d64[None, :] * s_oz_d + t64[:, None] * s_oz_l,
                             (y * zv * sig).to(out_z_ptr.dtype.element_ty), mask=mask)
                dy = dout * zv * sig
            else:
                dy = dout

            # adjoint g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}, carried in from the next chunk
            mask_next = (c * CHUNK + steps + 1 < seqlen)[:, None] & mask_d[None, :]
            dt_next, _ = _load_dt(dt_col + (t64 + 1)[:, None] * s_dt_l, mask_next, bias, HAS_DELTA_BIAS,
                                  DELTA_SOFTPLUS)
            p_rev, g_rev = tl.associative_scan(
                (tl.flip(tl.exp2(dt_next[:, None, :] * A2[None, :, :]), 0), tl.flip(Ct * dy[:, None, :], 0)),
                axis=0, combine_fn=_combine)
            g = tl.flip(g_rev + p_rev * g_next[None, :, :], 0)
            g_next = _step(g, steps, 0)

            gdt = g * dt[:, None, :]
            decayed_prev = hs - dBu  # exp(dt_t A) h_{t-1}, without dividing by the decay
            du = tl.sum(gdt * Bt, axis=1)
            if HAS_D:
                du += Dv[None, :] * dy
                dD_acc += tl.sum(dy * u, axis=0)
            ddt = tl.sum(g * (Bt * u[:, None, :] + A[None, :, :] * decayed_prev), axis=1)
            if DELTA_SOFTPLUS:
                ddt = tl.where(raw <= 20.0, ddt * tl.sigmoid(raw), ddt)
            ddt = tl.where(mask, ddt, 0.0)
            tl.store(du_ptr + b64 * s_du_b + d64[None, :] * s_du_d + t64[:, None] * s_du_l,
                     du.to(du_ptr.dtype.element_ty), mask=mask)
            tl.store(ddelta_ptr + b64 * s_ddt_b + d64[None, :] * s_ddt_d + t64[:, None] * s_ddt_l,
                     ddt.to(ddelta_ptr.dtype.element_ty), mask=mask)
            if HAS_DELTA_BIAS:
                ddb_acc += tl.sum(ddt, axis=0)
            dA_acc += tl.sum(gdt * decayed_prev, axis=0)

            mask_tn = mask_t[:, None] & mask_n[None, :]
            if B_VARIABLE:
                tl.atomic_add(dB_ptr + b64 * s_dB_b + group * s_dB_g + t64[:, None] * s_dB_l + n[None, :] * s_dB_n,
                              tl.sum(gdt * u[:, None, :], axis=2), mask=mask_tn, sem="relaxed")
            else:
                dB_acc += tl.sum(gdt * u[:, None, :], axis=0)
            if C_VARIABLE:
                tl.atomic_add(dC_ptr + b64 * s_dC_b + group * s_dC_g + t64[:, None] * s_dC_l + n[None, :] * s_dC_n,
                              tl.sum(hs * dy[:, None, :], axis=2), mask=mask_tn, sem="relaxed")
            else:
                dC_acc += tl.sum(hs * dy[:, None, :], axis=0)
        tl.debug_barrier()  # pass 1 of the previous segment overwrites the workspace

    tl.atomic_add(dA_ptr + n[:, None] + d64[None, :] * dstate, dA_acc, mask=mask_nd, sem="relaxed")
    if not B_VARIABLE:
        tl.atomic_add(dB_ptr + n[:, None] * s_dB_n + d64[None, :] * s_dB_d, dB_acc, mask=mask_nd, sem="relaxed")
    if not C_VARIABLE:
        tl.atomic_add(dC_ptr + n[:, None] * s_dC_n + d64[None, :] * s_dC_d, dC_acc, mask=mask_nd, sem="relaxed")
    if HAS_D:
        tl.atomic_add(dD_ptr + d, dD_acc, mask=mask_d, sem="relaxed")
    if HAS_DELTA_BIAS:
        tl.atomic_add(ddelta_bias_ptr + d, ddb_acc, mask=mask_d, sem="relaxed")


# ----------------------------------------------------------------------------------------------
# launchers

CHUNK = 8  # steps each thread scans in registers
# State elements (CHUNK x in-thread states) a thread holds per tile. At [8, 4096, 2048] dstate 16 on the
# H200 (benchmarks/results/selective_scan.json sweep): forward 32 dims a program 0.73 ms (16: 1.04,
# 8: 1.17); backward 8 dims 5.30 ms (4: 8.28, 16: 9.69): the backward keeps more tiles alive.
FWD_ELEMS_PER_THREAD = 128
BWD_ELEMS_PER_THREAD = 32


class ScanPlan(NamedTuple):
    """How seqlen is cut: chunks of ``chunk`` steps (one scan in registers), grouped in segments of
    ``seg_chunks`` chunks. The forward saves the state at each segment's end; the backward
    recomputes a segment's chunk-start states into a workspace, then walks its chunks in reverse.
    ``seg_chunks`` about sqrt(n_chunks) balances the saved states against the workspace."""
    chunk: int
    seg_chunks: int
    n_chunks: int
    n_segments: int


def scan_plan(seqlen: int, chunk=None, seg_chunks=None) -> ScanPlan:
    chunk = chunk or min(CHUNK, triton.next_power_of_2(max(seqlen, 1)))
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two, got {chunk}")
    n_chunks = max(1, triton.cdiv(seqlen, chunk))
    seg_chunks = seg_chunks or math.isqrt(n_chunks - 1) + 1
    if seg_chunks < 1:
        raise ValueError(f"seg_chunks: expected >= 1, got {seg_chunks}")
    seg_chunks = min(seg_chunks, n_chunks)
    return ScanPlan(chunk, seg_chunks, n_chunks, triton.cdiv(n_chunks, seg_chunks))


def states_shape(batch: int, dim: int, dstate: int, plan: ScanPlan):
    """The float32 segment-end states the forward saves for the backward (contiguous)."""
    return (batch, plan.n_segments, dstate, dim)


def workspace_shape(batch: int, dim: int, dstate: int, plan: ScanPlan):
    """The float32 workspace of the backward (contiguous): one segment's chunk-start states."""
    return (batch, plan.seg_chunks, dstate, dim)


def bc_layout(name: str, t, batch: int, dim: int, dstate: int, seqlen: int):
    """(variable, groups, strides (b, g, d, n, l)) of B or C; a [b, n, l] tensor is one group."""
    dims, st = T.shape(t), T.strides(t)
    if len(dims) == 2:
        T.check_same_shape(name, t, (dim, dstate))
        return False, 1, (0, 0, st[0], st[1], 0)
    if len(dims) == 3:
        T.check_same_shape(name, t, (batch, dstate, seqlen))
        return True, 1, (st[0], 0, 0, st[1], st[2])
    if len(dims) == 4:
        if dims[0] != batch or dims[2:] != (dstate, seqlen) or dims[1] < 1 or dim % dims[1]:
            raise ValueError(f"{name}: expected [batch={batch}, groups dividing dim={dim}, dstate={dstate}, "
                             f"seqlen={seqlen}], got {dims}")
        return True, dims[1], (st[0], st[1], 0, st[2], st[3])
    raise ValueError(f"{name}: expected [dim, dstate], [batch, dstate, seqlen] or [batch, groups, dstate, "
                     f"seqlen], got shape {dims}")


def _groups(B_layout, C_layout) -> int:
    groups = {lay[1] for lay in (B_layout, C_layout) if lay[0]}
    if len(groups) > 1:
        raise ValueError(f"B, C: input-dependent B and C must have the same number of groups, got {sorted(groups)}")
    return groups.pop() if groups else 1


def _check_seq(name, t, batch, dim, seqlen):
    if t is not None:
        T.check_same_shape(name, t, (batch, dim, seqlen))


def _check_vec(name, t, dim):
    if t is not None:
        T.check_same_shape(name, t, (dim,))


def _check_f32_buffer(name, t, shape):
    T.check_same_shape(name, t, shape)
    T.check_contiguous(name, t)
    if T.dtype_name(t) != "float32":
        raise TypeError(f"{name}: expected float32, got {T.dtype_name(t)}")


def _strides3(t):
    return T.strides(t) if t is not None else (0, 0, 0)


def _blocks(dim, dstate, groups, chunk, elems_per_thread, block_d=None, num_warps=None):
    """(BLOCK_D, BLOCK_N, num_warps): dims across the lanes, about ``elems_per_thread`` state elements
    of a [chunk, BLOCK_N, BLOCK_D] tile in each thread; a block of dims stays inside one group."""
    block_n = triton.next_power_of_2(dstate)
    dim_per_group = dim // groups
    if block_d is None:
        block_d = max(1, min(32 * elems_per_thread // (chunk * block_n), triton.next_power_of_2(dim)))
        if groups > 1:
            block_d = min(block_d, dim_per_group & -dim_per_group)
    elif block_d < 1 or block_d & (block_d - 1) or (groups > 1 and dim_per_group % block_d):
        raise ValueError(f"block_d: expected a power of two dividing dim / groups = {dim_per_group}, got {block_d}")
    return block_d, block_n, num_warps or max(1, min(4, block_d // 32))


def _scan_args(u, delta, A, B, C, D, z, delta_bias):
    """Shapes checked; (batch, dim, seqlen, dstate, groups, B layout, C layout)."""
    if len(T.shape(u)) != 3:
        raise ValueError(f"u: expected [batch, dim, seqlen], got shape {T.shape(u)}")
    batch, dim, seqlen = T.shape(u)
    if len(T.shape(A)) != 2 or T.shape(A)[0] != dim:
        raise ValueError(f"A: expected [dim={dim}, dstate], got shape {T.shape(A)}")
    dstate = T.shape(A)[1]
    for name, t in (("delta", delta), ("z", z)):
        _check_seq(name, t, batch, dim, seqlen)
    _check_vec("D", D, dim)
    _check_vec("delta_bias", delta_bias, dim)
    B_lay, C_lay = bc_layout("B", B, batch, dim, dstate, seqlen), bc_layout("C", C, batch, dim, dstate, seqlen)
    return batch, dim, seqlen, dstate, _groups(B_lay, C_lay), B_lay, C_lay


def selective_scan_fwd(u, delta, A, B, C, out, D=None, z=None, delta_bias=None, states=None, last_state=None,
                       delta_softplus: bool = False, plan: ScanPlan | None = None, block_d=None,
                       num_warps=None) -> None:
    """out[b, d, l] = the scan (gated by silu(z) when z is given), written in place; also the
    float32 segment-end ``states`` (``states_shape(..., plan)``) the backward needs, and
    ``last_state`` [b, d, n], each when given. ``plan`` (default ``scan_plan(seqlen)``) must be
    passed unchanged to the backward."""
    batch, dim, seqlen, dstate, groups, B_lay, C_lay = _scan_args(u, delta, A, B, C, D, z, delta_bias)
    _check_seq("out", out, batch, dim, seqlen)
    plan = plan or scan_plan(seqlen)
    block_d, block_n, num_warps = _blocks(dim, dstate, groups, plan.chunk, FWD_ELEMS_PER_THREAD, block_d, num_warps)
    if states is not None:
        _check_f32_buffer("states", states, states_shape(batch, dim, dstate, plan))
    if last_state is not None:
        T.check_same_shape("last_state", last_state, (batch, dim, dstate))
        if T.strides(last_state)[2] != 1:
            raise ValueError(f"last_state: last axis must be contiguous, got strides {T.strides(last_state)}")
    if batch * dim * seqlen == 0:
        return
    st_st = T.strides(states)[:3] if states is not None else (0, 0, 0)
    last_st = T.strides(last_state)[:2] if last_state is not None else (0, 0)
    _selective_scan_fwd_kernel[(triton.cdiv(dim, block_d), batch)](
        u, delta, A, B, C, D, z, delta_bias, out, states, last_state,
        dim, seqlen, dstate, dim // groups, plan.n_chunks, plan.seg_chunks,
        *T.strides(u), *T.strides(delta), *T.strides(A), *B_lay[2], *C_lay[2],
        *_strides3(z), *T.strides(out), *st_st, *last_st,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=bool(delta_softplus), B_VARIABLE=B_lay[0], C_VARIABLE=C_lay[0],
        STORE_STATES=states is not None, STORE_LAST=last_state is not None,
        BLOCK_D=block_d, BLOCK_N=block_n, CHUNK=plan.chunk, num_warps=num_warps)


def selective_scan_bwd(u, delta, A, B, C, dout, states, workspace, du, ddelta, dA, dB, dC, D=None, z=None,
                       delta_bias=None, dD=None, dz=None, ddelta_bias=None, out_z=None,
                       delta_softplus: bool = False, plan: ScanPlan | None = None, block_d=None,
                       num_warps=None) -> None:
    """Gradients of the scan. Written in place: du, ddelta [b, d, l], dz (when z is given) and
    out_z = the forward output recomputed (optional, with z). Accumulated (+=, float32, the caller
    zeroes them): dA [d, n] contiguous, dB/dC shaped like B/C, dD and ddelta_bias [d] (when D /
    delta_bias are given). ``states`` and ``plan`` are the forward's; ``workspace`` is float32
    ``workspace_shape(..., plan)``."""
    batch, dim, seqlen, dstate, groups, B_lay, C_lay = _scan_args(u, delta, A, B, C, D, z, delta_bias)
    for name, t in (("dout", dout), ("du", du), ("ddelta", ddelta), ("dz", dz), ("out_z", out_z)):
        _check_seq(name, t, batch, dim, seqlen)
    if (z is None) != (dz is None):
        raise ValueError("dz: expected exactly when z is given")
    if out_z is not None and z is None:
        raise ValueError("out_z: the recomputed output is only written when z is given")
    for name, t, given, what in (("dD", dD, D, "D"), ("ddelta_bias", ddelta_bias, delta_bias, "delta_bias")):
        if (t is None) != (given is None):
            raise ValueError(f"{name}: expected exactly when {what} is given")
        if t is not None:
            _check_f32_buffer(name, t, (dim,))
    _check_f32_buffer("dA", dA, (dim, dstate))
    dB_lay, dC_lay = bc_layout("dB", dB, batch, dim, dstate, seqlen), bc_layout("dC", dC, batch, dim, dstate, seqlen)
    for name, t, like in (("dB", dB, B), ("dC", dC, C)):
        T.check_same_shape(name, t, T.shape(like))
        if T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected a float32 accumulator, got {T.dtype_name(t)}")
    plan = plan or scan_plan(seqlen)
    block_d, block_n, num_warps = _blocks(dim, dstate, groups, plan.chunk, BWD_ELEMS_PER_THREAD, block_d, num_warps)
    _check_f32_buffer("states", states, states_shape(batch, dim, dstate, plan))
    _check_f32_buffer("workspace", workspace, workspace_shape(batch, dim, dstate, plan))
    if batch * dim * seqlen == 0:
        return
    _selective_scan_bwd_kernel[(triton.cdiv(dim, block_d), batch)](
        u, delta, A, B, C, D, z, delta_bias, dout, states, workspace,
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, out_z,
        dim, seqlen, dstate, dim // groups, plan.n_segments, plan.seg_chunks,
        *T.strides(u), *T.strides(delta), *T.strides(A), *B_lay[2], *C_lay[2],
        *_strides3(z), *T.strides(dout), *T.strides(states)[:3], *T.strides(workspace)[:3],
        *T.strides(du), *T.strides(ddelta), *_strides3(dz), *_strides3(out_z), *dB_lay[2], *dC_lay[2],
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=bool(delta_softplus), B_VARIABLE=B_lay[0], C_VARIABLE=C_lay[0],
        STORE_OUT_Z=out_z is not None, BLOCK_D=block_d, BLOCK_N=block_n, CHUNK=plan.chunk, num_warps=num_warps)


def compile_cases():
    """The canonical case (variable B/C, D, z, delta_bias, softplus) in each dtype, the fixed-B/C,
    grouped and plain (no D/z/bias) variants in bf16."""
    S = T.SpecTensor
    batch, dim, seqlen, dstate = 8, 4096, 2048, 16
    plan = scan_plan(seqlen)
    cases = [(dtype, "variable") for dtype in T.FLOAT_DTYPES] + \
        [("bfloat16", kind) for kind in ("fixed", "grouped", "plain")]
    for dtype, kind in cases:
        u, delta, z, out, du, ddelta, dz = (S((batch, dim, seqlen), dtype) for _ in range(7))
        if kind == "fixed":
            Bs, Cs = S((dim, dstate), "float32"), S((dim, dstate), "float32")
        elif kind == "grouped":
            Bs, Cs = S((batch, 4, dstate, seqlen), dtype), S((batch, 4, dstate, seqlen), dtype)
        else:
            Bs, Cs = S((batch, dstate, seqlen), dtype), S((batch, dstate, seqlen), dtype)
        A, D, bias = S((dim, dstate), "float32"), S((dim,), "float32"), S((dim,), "float32")
        if kind == "plain":
            D = z = bias = dz = None
        states = S(states_shape(batch, dim, dstate, plan), "float32")
        work = S(workspace_shape(batch, dim, dstate, plan), "float32")
        last = S((batch, dim, dstate), "float32")
        dA, dB, dC = S((dim, dstate), "float32"), S(Bs.shape, "float32"), S(Cs.shape, "float32")
        dD, ddb = (S((dim,), "float32"), S((dim,), "float32")) if kind != "plain" else (None, None)
        yield f"selective_scan_fwd[{dtype},{kind}]", lambda a=(u, delta, A, Bs, Cs, out, D, z, bias, states, last): \
            selective_scan_fwd(*a, delta_softplus=kind != "plain")
        yield f"selective_scan_bwd[{dtype},{kind}]", \
            lambda a=(u, delta, A, Bs, Cs, out, states, work, du, ddelta, dA, dB, dC, D, z, bias, dD, dz, ddb,
                      out if z is not None else None): \
            selective_scan_bwd(*a, delta_softplus=kind != "plain")
