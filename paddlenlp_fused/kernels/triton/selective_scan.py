"""Mamba-1 selective scan: forward and backward (recompute); the decoding step is in ``state_update.py``.

Shapes (``b`` batch, ``d`` dim, ``n`` dstate, ``l`` seqlen, ``g`` groups):
    u, delta, z, out, du, ddelta, dz     [b, d, l]   any strides (contiguous along l is fastest)
    A                                     [d, n]      real
    B, C                                  [d, n] (fixed), [b, n, l] or [b, g, n, l] (input-dependent;
                                          dim d reads group d // (dim / g))
    D, delta_bias                         [d]
    states (saved for backward)           [b, n_segments, n, d] float32: the state at each segment's end
    workspace (backward)                  [b, bwd_seg_chunks, n, d] float32: a segment's chunk-start states
    last_state                            [b, d, n]

Recurrence, per (b, d, n) and time t, in fp32:
    dt_t = softplus(delta_t + delta_bias)         (softplus optional, threshold 20 as torch/paddle)
    h_t  = exp(dt_t A) h_{t-1} + dt_t B_t u_t,    h_{-1} = 0
    y_t  = sum_n C_t h_t + D u_t;   out_t = y_t * silu(z_t) when z is given.

One program per (batch, block of dims) walks seqlen in chunks of ``CHUNK`` steps (``ScanPlan``).
Each chunk loads u/delta/z/B/C tiles coalesced along seqlen and scans ``[CHUNK, dims, states]``
tiles along the chunk axis, which each thread holds in registers; the state carried between chunks
enters the chunk's first step, so a step costs one FFMA. The forward saves the state at every
segment end (a segment is ``seg_chunks`` chunks). The backward walks the segments in reverse in
chunks of ``bwd_chunk`` steps: pass 1 recomputes the segment's chunk-start states into
``workspace``; pass 2 walks its chunks in reverse, recomputes each chunk's states from its start
state and scans the adjoint ``g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}`` backwards (the decay of
step t + 1 is the chunk's own decay tile shifted by one step, plus the first decay of the chunk
after it, carried with ``g``). With ``gB = sum_n g B`` and ``q = g exp(dt A) h_{t-1}``: du = dt gB +
D dy, ddt = (u gB + sum_n A q) softplus'(.), dA = sum_t dt q. Gradients that sum over programs (dA,
dD, ddelta_bias, fixed dB/dC over the batch; input-dependent dB/dC over the dims of a group) are
accumulated with fp32 atomics into zero-initialised buffers that the caller provides, or
(``partials``: deterministic) stored per program in a float32 workspace and added in a fixed order
(``partial_sums.add_parts``).

Complex A (mamba_ssm's convention; the launchers take no complex dtype): every complex tensor comes
as real (re, im) pairs along a trailing axis of 2 with stride 1 (a ``view_as_real``): A [d, n, 2];
fixed B, C [d, n, 2]; input-dependent B, C [b, (g,) n, l, 2] (mamba_ssm's [b, (g,) n, 2 l] viewed
so); last_state, dA and fixed dB/dC [.., 2] likewise, input-dependent dB/dC shaped like B/C; states
and workspace float32 with a (re, im) plane axis before n. The recurrence runs in complex
arithmetic and y_t = 2 Re(sum_n C_t h_t) + D u_t. The backward scans g_t = conj(dL/dh_t) =
2 dy_t C_t + exp(dt_{t+1} A) g_{t+1}, the real recurrence's form; with gB = sum_n Re(g B), q = g
exp(dt A) h_{t-1}: du = dt gB + D dy, ddt = (u gB + sum_n Re(q A)) softplus'(.), dA = sum_t dt
conj(q), dB = dt u conj(g), dC = 2 dy conj(h) (gradients of complex tensors are dL/dre + i dL/dim,
Paddle's and torch's convention). A ``COMPLEX`` constexpr selects this in the same kernels: the real
build is unchanged.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import triton
import triton.language as tl

from ...runtime import tensor as T
from .partial_sums import add_parts

# The interpreter runs no inline PTX: it takes tl.log2 where the GPU takes MUFU's lg2 (see _log2).
_INTERPRET = tl.constexpr(bool(triton.knobs.runtime.interpret))

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)
_INV_2PI = tl.constexpr(0.15915494309189535)
# 2 pi as HI + LO: HI = 201 / 32 has 8 significant bits, so k HI is exact for |k| < 2^16
_2PI_HI = tl.constexpr(6.28125)
_2PI_LO = tl.constexpr(0.0019353071795864769)


@triton.jit
def _combine(a_first, b_first, a_second, b_second):
    """Compose h -> a_first h + b_first, then h -> a_second h + b_second."""
    return a_first * a_second, b_first * a_second + b_second


@triton.jit
def _combine_complex(a_re_first, a_im_first, b_re_first, b_im_first, a_re_second, a_im_second, b_re_second,
                     b_im_second):
    """``_combine`` with complex a and b as (re, im) parts."""
    return (a_re_first * a_re_second - a_im_first * a_im_second, a_re_first * a_im_second + a_im_first * a_re_second,
            b_re_first * a_re_second - b_im_first * a_im_second + b_re_second,
            b_re_first * a_im_second + b_im_first * a_re_second + b_im_second)


@triton.jit
def _log2(x):
    # tl.log2 compiles to a ~20-instruction polynomial; lg2.approx is one MUFU instruction (rel. error 2^-22)
    if _INTERPRET:
        return tl.log2(x)
    else:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x], dtype=tl.float32,
                                         is_pure=True, pack=1)


@triton.jit
def _cos_sin(x):
    """(cos x, sin x). tl.cos / tl.sin call libdevice, branchy with a slow path for large arguments;
    on the GPU x is reduced to [-pi, pi] instead (two-constant Cody-Waite: x - 2 pi k exact while
    |k| < 2^16) for MUFU's cos.approx / sin.approx (absolute error about 2^-21 there)."""
    if _INTERPRET:
        return tl.cos(x), tl.sin(x)
    else:
        k = tl.floor(x * _INV_2PI + 0.5)
        r = tl.fma(k, -_2PI_LO, tl.fma(k, -_2PI_HI, x))
        return (tl.inline_asm_elementwise("cos.approx.ftz.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True,
                                          pack=1),
                tl.inline_asm_elementwise("sin.approx.ftz.f32 $0, $1;", "=f,f", [r], dtype=tl.float32, is_pure=True,
                                          pack=1))


@triton.jit
def _softplus(x):
    # torch/paddle softplus with threshold 20; exp overflow above it is discarded by the where. Through
    # exp2/log2 (one MUFU instruction each): tl.exp/tl.log cost ~30 instructions, a fifth of the backward.
    return tl.where(x <= 20.0, _log2(1.0 + tl.exp2(x * _LOG2E)) * _LN2, x)


@triton.jit
def _sigmoid(x):
    # approximate division (MUFU rcp): tl.sigmoid divides with IEEE rounding, a dozen instructions
    return tl.fdiv(1.0, 1.0 + tl.exp2(-x * _LOG2E), ieee_rounding=False)


@triton.jit
def _dt_of(delta_raw, mask, bias, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr):
    """(dt, delta + bias) of a delta tile [CHUNK, R, L]; dt is 0 outside ``mask`` so that padded steps
    and dims neither decay nor feed the state."""
    raw = delta_raw.to(tl.float32)
    if HAS_DELTA_BIAS:
        raw += bias[None, :, :]
    dt = _softplus(raw) if DELTA_SOFTPLUS else raw
    return tl.where(mask, dt, 0.0), raw


@triton.jit
def _chunk_steps(c, steps, mask_d, seqlen, CHUNK: tl.constexpr):
    """(steps of chunk c as int64, mask over them, mask [CHUNK, R, L]); chunk -1 is all masked."""
    t = c * CHUNK + steps
    mask_t = (t < seqlen) & (t >= 0)
    return t.to(tl.int64), mask_t, mask_t[:, None, None] & mask_d[None, :, :]


@triton.jit
def _load_seq(col, t64, mask, s_l):
    """A [CHUNK, R, L] tile of a [b, d, l] tensor (``col`` [R, L]: its dims' rows), as stored."""
    return tl.load(col[None, :, :] + t64[:, None, None] * s_l, mask=mask, other=0.0)


@triton.jit
def _load_bc(ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_b, s_g, s_d, s_n, s_l,
             VARIABLE: tl.constexpr):
    """B or C as stored: [CHUNK, BLOCK_N] when input-dependent ([b, g, n, l]), a state tile [R, BLOCK_N,
    L] when fixed ([d, n])."""
    if VARIABLE:
        tile = tl.load(ptr + b64 * s_b + group * s_g + t64[:, None] * s_l + n[None, :] * s_n,
                       mask=mask_t[:, None] & mask_n[None, :], other=0.0)
    else:
        tile = tl.load(ptr + n[None, :, None] * s_n + d64[:, None, :] * s_d,
                       mask=mask_n[None, :, None] & mask_d[:, None, :], other=0.0)
    return tile


@triton.jit
def _load_bc_parts(ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_b, s_g, s_d, s_n, s_l,
                   VARIABLE: tl.constexpr, COMPLEX: tl.constexpr):
    """``_load_bc``; for complex A the (re, im) pair of such tiles (the imaginary part one element on)."""
    if COMPLEX:
        return (_load_bc(ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_b, s_g, s_d, s_n, s_l, VARIABLE),
                _load_bc(ptr + 1, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_b, s_g, s_d, s_n, s_l, VARIABLE))
    else:
        return _load_bc(ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_b, s_g, s_d, s_n, s_l, VARIABLE)


@triton.jit
def _bc_tile(raw, VARIABLE: tl.constexpr):
    """A loaded B or C in fp32, broadcastable against the [CHUNK, R, BLOCK_N, L] tiles."""
    if VARIABLE:
        return raw.to(tl.float32)[:, None, :, None]
    else:
        return raw.to(tl.float32)[None, :, :, :]


@triton.jit
def _bc_tiles(raw, VARIABLE: tl.constexpr, COMPLEX: tl.constexpr):
    """``_bc_tile`` of what ``_load_bc_parts`` loaded (for complex A, of each part)."""
    if COMPLEX:
        return _bc_tile(raw[0], VARIABLE), _bc_tile(raw[1], VARIABLE)
    else:
        return _bc_tile(raw, VARIABLE)


@triton.jit
def _out_terms(hs, Ct, COMPLEX: tl.constexpr):
    """y_t before D and z, [CHUNK, R, L], from the states and C ([CHUNK, R, BLOCK_N, L] tiles): sum_n C_t
    h_t, for complex A 2 Re(sum_n C_t h_t) (mamba_ssm's: the state and its conjugate)."""
    if COMPLEX:
        return 2.0 * tl.sum(hs[0] * Ct[0] - hs[1] * Ct[1], axis=2)
    else:
        return tl.sum(hs * Ct, axis=2)


@triton.jit
def _step(x, steps, which):
    """x[which] of a [CHUNK, R, BLOCK_N, L] tile as a state tile [R, BLOCK_N, L] (an in-thread select:
    the chunk axis is held by each thread)."""
    return tl.sum(tl.where((steps == which)[:, None, None, None], x, -0.0), axis=0)  # x + -0.0 folds away


@triton.jit
def _last_two(before_1, last_1, len_1, before_2, last_2, len_2):
    """(the element before the last, the last, the length) of two concatenated runs: associative."""
    return tl.where(len_2 >= 2, before_2, last_1), last_2, len_1 + len_2


@triton.jit
def _previous_steps(x, first):
    """y_t = x_{t-1} along the chunk axis of a [CHUNK, R, BLOCK_N, L] tile, y_0 = ``first`` [R, BLOCK_N,
    L]. A scan of (before-last, last, length) summaries: its lengths are constants, so the
    compiler folds the scan into register moves."""
    y, _, _ = tl.associative_scan((tl.broadcast_to(first[None, :, :, :], x.shape), x, tl.full(x.shape, 1, tl.int32)),
                                  axis=0, combine_fn=_last_two)
    return y


@triton.jit
def _scan_from(carry, decay, x, steps):
    """s_t = decay_t s_{t-1} + x_t along the chunk axis from s_{-1} = ``carry`` [R, BLOCK_N, L]. The
    carry enters the first step's x, so only the x half of the scan's pairs is used and the compiler
    drops the running product of decays (one FFMA a step instead of FMUL + 2 FFMA)."""
    x = tl.where((steps == 0)[:, None, None, None], x + decay * carry[None, :, :, :], x)
    _, s = tl.associative_scan((decay, x), axis=0, combine_fn=_combine)
    return s


@triton.jit
def _scan_from_complex(carry, decay, x, steps):
    """``_scan_from`` in complex arithmetic: carry, decay and x are (re, im) pairs, and so is the result."""
    first = (steps == 0)[:, None, None, None]
    c_re, c_im = carry[0][None, :, :, :], carry[1][None, :, :, :]
    x_re = tl.where(first, x[0] + decay[0] * c_re - decay[1] * c_im, x[0])
    x_im = tl.where(first, x[1] + decay[0] * c_im + decay[1] * c_re, x[1])
    _, _, s_re, s_im = tl.associative_scan((decay[0], decay[1], x_re, x_im), axis=0, combine_fn=_combine_complex)
    return s_re, s_im


@triton.jit
def _steps(x, steps, which, COMPLEX: tl.constexpr):
    """``_step`` of a tile, or for complex A of each part of an (re, im) pair."""
    if COMPLEX:
        return _step(x[0], steps, which), _step(x[1], steps, which)
    else:
        return _step(x, steps, which)


@triton.jit
def _load_pair(ptrs, mask, plane):
    """A complex state tile as an (re, im) pair of float32 [R, BLOCK_N, L] tiles, the imaginary plane
    ``plane`` elements after the real one (0 outside mask)."""
    return tl.load(ptrs, mask=mask, other=0.0), tl.load(ptrs + plane, mask=mask, other=0.0)


@triton.jit
def _store_pair(ptrs, h, mask, plane):
    """Stores what ``_load_pair`` loads."""
    tl.store(ptrs, h[0], mask=mask)
    tl.store(ptrs + plane, h[1], mask=mask)


@triton.jit
def _reverse_scan_complex(g_next, decay, decay_next, Ct, dy2, steps):
    """The adjoint g_t = 2 dy_t C_t + exp(dt_{t+1} A) g_{t+1} of a chunk for complex A ((re, im)
    pairs; dy2 = 2 dy [CHUNK, R, L]), scanned as the real one: flipped, each decay moved one step
    (the next chunk's first, ``decay_next``, entering), from ``g_next``."""
    g = _scan_from_complex(g_next, (_previous_steps(tl.flip(decay[0], 0), decay_next[0]),
                                    _previous_steps(tl.flip(decay[1], 0), decay_next[1])),
                           (tl.flip(Ct[0] * dy2[:, :, None, :], 0), tl.flip(Ct[1] * dy2[:, :, None, :], 0)), steps)
    return tl.flip(g[0], 0), tl.flip(g[1], 0)


# Tiles are [CHUNK, R, BLOCK_N, L] with BLOCK_D = R * L dims (dim pid * BLOCK_D + r * L + l); tiles of
# one value per (step, dim) are [CHUNK, R, L], per (state, dim) "state tiles" [R, BLOCK_N, L].
# Triton's default layout gives the lanes to the last axes: L dims across lanes, then states; each
# thread holds whole chunks of steps, R dims and the rest of the states. The scan over steps runs
# inside a thread and the sums over states mostly do; the backward's sums over dims (input-dependent
# dB/dC) add the R in-thread dims before crossing lanes. The adjoint's reverse scan is a forward
# scan of flipped tiles: Triton lowers ``reverse=True`` with warp shuffles even along an in-thread
# axis, a flip is free.


@triton.jit
def _add_over_dims(ptrs, x, mask):
    """Atomically adds x [CHUNK, R, BLOCK_N, L] summed over its dims to ptrs [CHUNK, BLOCK_N]: the R
    in-thread dims first, then the L dims across lanes (shuffles). One atomic per (step, state) and
    program: splitting the lane sum over 2 or 4 atomics was no faster on the H200."""
    tl.atomic_add(ptrs, tl.sum(tl.sum(x, axis=1), axis=2), mask=mask, sem="relaxed")


@triton.jit
def _store_over_dims(ptrs, x, mask):
    """``_add_over_dims`` for the deterministic mode: ptrs is this program's own partial row."""
    tl.store(ptrs, tl.sum(tl.sum(x, axis=1), axis=2), mask=mask)


@triton.jit
def _bc_grad(acc, x, per_dim, part_ptr, part_ofs, bc_row, part_n, t_part, grad_ptr, b64, s_b, group, s_g, t64, s_l,
             n, s_n, mask_tn, VARIABLE: tl.constexpr, DETERMINISTIC: tl.constexpr):
    """Adds a chunk's terms x * per_dim of dB or dC (x [CHUNK, R, BLOCK_N, L], per_dim [CHUNK, R, L];
    for complex A one part of the pair). Input-dependent: summed over the dims into this program's
    partial row (element n part_n + t_part of the row at part_ptr + part_ofs + bc_row; deterministic)
    or atomically into the gradient's row at grad_ptr; fixed: into the state tile acc, returned."""
    if VARIABLE and DETERMINISTIC:
        _store_over_dims(part_ptr + part_ofs + bc_row + n[None, :] * part_n + t_part[:, None],
                         x * per_dim[:, :, None, :], mask_tn)
    elif VARIABLE:
        _add_over_dims(grad_ptr + b64 * s_b + group * s_g + t64[:, None] * s_l + n[None, :] * s_n,
                       x * per_dim[:, :, None, :], mask_tn)
    else:
        acc += tl.sum(x * per_dim[:, :, None, :], axis=0)
    return acc


@triton.jit
def _put_pair(ptrs, x, mask, DETERMINISTIC: tl.constexpr):
    """A program's sums, an (re, im) pair of tiles, to adjacent elements at ptrs: stored (its own
    partial slot; deterministic) or added atomically."""
    if DETERMINISTIC:
        tl.store(ptrs, x[0], mask=mask)
        tl.store(ptrs + 1, x[1], mask=mask)
    else:
        tl.atomic_add(ptrs, x[0], mask=mask, sem="relaxed")
        tl.atomic_add(ptrs + 1, x[1], mask=mask, sem="relaxed")


@triton.jit
def _chunk_inputs(c, u_col, dt_col, B_ptr, b64, group, d64, n, steps, mask_d, mask_n, seqlen,
                  s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, B_VARIABLE: tl.constexpr, CHUNK: tl.constexpr,
                  COMPLEX: tl.constexpr):
    """(u, delta, B) of chunk c as stored: what its states need."""
    t64, mask_t, mask = _chunk_steps(c, steps, mask_d, seqlen, CHUNK)
    return (_load_seq(u_col, t64, mask, s_u_l), _load_seq(dt_col, t64, mask, s_dt_l),
            _load_bc_parts(B_ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l,
                           B_VARIABLE, COMPLEX))


@triton.jit
def _chunk_tiles(c, u_col, dt_col, z_col, do_col, B_ptr, C_ptr, b64, group, d64, n, steps, mask_d, mask_n, seqlen,
                 s_u_l, s_dt_l, s_z_l, s_do_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, s_C_b, s_C_g, s_C_d, s_C_n, s_C_l,
                 B_VARIABLE: tl.constexpr, C_VARIABLE: tl.constexpr, CHUNK: tl.constexpr, COMPLEX: tl.constexpr):
    """(u, delta, B, C, z, dout) of chunk c as stored (``z_col``/``do_col`` may repeat another column:
    tiles never read are dropped by the compiler). Loaded one chunk ahead of their use, their latency
    hides behind a chunk's arithmetic."""
    t64, mask_t, mask = _chunk_steps(c, steps, mask_d, seqlen, CHUNK)
    u_raw, delta_raw, B_raw = _chunk_inputs(c, u_col, dt_col, B_ptr, b64, group, d64, n, steps, mask_d, mask_n,
                                            seqlen, s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, B_VARIABLE,
                                            CHUNK, COMPLEX)
    C_raw = _load_bc_parts(C_ptr, b64, group, d64, n, t64, mask_d, mask_n, mask_t, s_C_b, s_C_g, s_C_d, s_C_n, s_C_l,
                           C_VARIABLE, COMPLEX)
    return u_raw, delta_raw, B_raw, C_raw, _load_seq(z_col, t64, mask, s_z_l), _load_seq(do_col, t64, mask, s_do_l)


@triton.jit
def _chunk_states(h, u_raw, delta_raw, B_raw, mask, steps, A2, bias, HAS_DELTA_BIAS: tl.constexpr,
                  DELTA_SOFTPLUS: tl.constexpr, B_VARIABLE: tl.constexpr, COMPLEX: tl.constexpr):
    """The states ([CHUNK, R, BLOCK_N, L]) of a chunk from its inputs (``_chunk_inputs``) and the
    state h before it, with what the backward reuses: (hs, exp(dt A), u, dt, delta + bias, B, dt u, dt B u).
    For complex A, h, A2 (its real part in log2 units), B_raw, hs, exp(dt A), B and dt B u are (re, im)
    pairs."""
    u = u_raw.to(tl.float32)
    dt, raw = _dt_of(delta_raw, mask, bias, HAS_DELTA_BIAS, DELTA_SOFTPLUS)
    Bt = _bc_tiles(B_raw, B_VARIABLE, COMPLEX)
    dtu = dt * u
    if COMPLEX:
        dBu = (dtu[:, :, None, :] * Bt[0], dtu[:, :, None, :] * Bt[1])
        cos, sin = _cos_sin(dt[:, :, None, :] * A2[1][None, :, :, :])
        modulus = tl.exp2(dt[:, :, None, :] * A2[0][None, :, :, :])
        decay = (modulus * cos, modulus * sin)
        hs = _scan_from_complex(h, decay, dBu, steps)
    else:
        dBu = dtu[:, :, None, :] * Bt
        decay = tl.exp2(dt[:, :, None, :] * A2[None, :, :, :])
        hs = _scan_from(h, decay, dBu, steps)
    return hs, decay, u, dt, raw, Bt, dtu, dBu


@triton.jit
def _program_tiles(dim, dstate, dim_per_group, R: tl.constexpr, L: tl.constexpr, BLOCK_N: tl.constexpr,
                   CHUNK: tl.constexpr):
    """This program's channels d [R, L] (and 64-bit), their mask, the dstate index n and its mask, the
    chunk's steps, the channels' group (the launcher keeps a block inside one group) and the mask of
    the state tiles [R, BLOCK_N, L]."""
    pid_d = tl.program_id(0)
    d = pid_d * (R * L) + tl.arange(0, R)[:, None] * L + tl.arange(0, L)[None, :]
    mask_d = d < dim
    n = tl.arange(0, BLOCK_N)
    mask_n = n < dstate
    mask_nd = mask_n[None, :, None] & mask_d[:, None, :]
    return d, d.to(tl.int64), mask_d, n, mask_n, tl.arange(0, CHUNK), (pid_d * (R * L)) // dim_per_group, mask_nd


@triton.jit
def _selective_scan_fwd_kernel(
        u_ptr, delta_ptr, A_ptr, B_ptr, C_ptr, D_ptr, z_ptr, delta_bias_ptr, out_ptr, states_ptr, last_ptr,
        dim, seqlen, dstate, dim_per_group, num_chunks, seg_chunks,
        s_u_b, s_u_d, s_u_l, s_dt_b, s_dt_d, s_dt_l, s_A_d, s_A_n,
        s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, s_C_b, s_C_g, s_C_d, s_C_n, s_C_l,
        s_z_b, s_z_d, s_z_l, s_o_b, s_o_d, s_o_l, s_st_b, s_st_s, s_st_n, s_last_b, s_last_d,
        HAS_D: tl.constexpr, HAS_Z: tl.constexpr, HAS_DELTA_BIAS: tl.constexpr, DELTA_SOFTPLUS: tl.constexpr,
        B_VARIABLE: tl.constexpr, C_VARIABLE: tl.constexpr, STORE_STATES: tl.constexpr,
        STORE_LAST: tl.constexpr, R: tl.constexpr, L: tl.constexpr,
        BLOCK_N: tl.constexpr, CHUNK: tl.constexpr, COMPLEX: tl.constexpr = False):
    b64 = tl.program_id(1).to(tl.int64)
    d, d64, mask_d, n, mask_n, steps, group, mask_nd = _program_tiles(dim, dstate, dim_per_group, R, L, BLOCK_N,
                                                                      CHUNK)

    A_nd = A_ptr + n[None, :, None] * s_A_n + d64[:, None, :] * s_A_d
    if COMPLEX:  # the decay's modulus through exp2, its phase through cos/sin
        A2 = (tl.load(A_nd, mask=mask_nd, other=0.0).to(tl.float32) * _LOG2E,
              tl.load(A_nd + 1, mask=mask_nd, other=0.0).to(tl.float32))
        h = (tl.zeros([R, BLOCK_N, L], dtype=tl.float32), tl.zeros([R, BLOCK_N, L], dtype=tl.float32))
    else:
        A2 = tl.load(A_nd, mask=mask_nd, other=0.0).to(tl.float32)
        A2 = A2 * _LOG2E
        h = tl.zeros([R, BLOCK_N, L], dtype=tl.float32)
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = None
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    u_col = u_ptr + b64 * s_u_b + d64 * s_u_d
    dt_col = delta_ptr + b64 * s_dt_b + d64 * s_dt_d
    o_col = out_ptr + b64 * s_o_b + d64 * s_o_d
    if HAS_Z:
        z_col = z_ptr + b64 * s_z_b + d64 * s_z_d
    else:
        z_col = u_col  # z tiles are then loaded and never read: the compiler drops the loads

    tiles = _chunk_tiles(0, u_col, dt_col, z_col, z_col, B_ptr, C_ptr, b64, group, d64, n, steps, mask_d, mask_n,
                         seqlen, s_u_l, s_dt_l, s_z_l, s_z_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, s_C_b, s_C_g, s_C_d,
                         s_C_n, s_C_l, B_VARIABLE, C_VARIABLE, CHUNK, COMPLEX)
    for c in range(num_chunks):
        t64, mask_t, mask = _chunk_steps(c, steps, mask_d, seqlen, CHUNK)
        cur = tiles  # loaded one chunk ahead: the loads overlap this chunk's scan
        tiles = _chunk_tiles(c + 1, u_col, dt_col, z_col, z_col, B_ptr, C_ptr, b64, group, d64, n, steps, mask_d,
                             mask_n, seqlen, s_u_l, s_dt_l, s_z_l, s_z_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, s_C_b,
                             s_C_g, s_C_d, s_C_n, s_C_l, B_VARIABLE, C_VARIABLE, CHUNK, COMPLEX)
        u_cur, delta_cur, B_cur, C_cur, z_cur, _ = cur
        hs, _, u, _, _, _, _, _ = _chunk_states(h, u_cur, delta_cur, B_cur, mask, steps, A2, bias, HAS_DELTA_BIAS,
                                                DELTA_SOFTPLUS, B_VARIABLE, COMPLEX)
        y = _out_terms(hs, _bc_tiles(C_cur, C_VARIABLE, COMPLEX), COMPLEX)
        if HAS_D:
            y += Dv[None, :, :] * u
        if HAS_Z:
            zv = z_cur.to(tl.float32)
            y = y * zv * _sigmoid(zv)
        tl.store(o_col[None, :, :] + t64[:, None, None] * s_o_l, y.to(out_ptr.dtype.element_ty), mask=mask)
        h = _steps(hs, steps, CHUNK - 1, COMPLEX)  # padded steps keep the state (dt = 0)
        if STORE_STATES:  # the state at each segment's end (the backward's restart points)
            seg_end = ((c + 1) % seg_chunks == 0) | (c == num_chunks - 1)
            if COMPLEX:
                _store_pair(states_ptr + b64 * s_st_b + (c // seg_chunks) * s_st_s + n[None, :, None] * s_st_n
                            + d64[:, None, :], h, mask_nd & seg_end, dstate * s_st_n)
            else:
                tl.store(states_ptr + b64 * s_st_b + (c // seg_chunks) * s_st_s + n[None, :, None] * s_st_n
                         + d64[:, None, :], h, mask=mask_nd & seg_end)
    if STORE_LAST:
        if COMPLEX:  # [b, d, n, 2]
            last_nd = last_ptr + b64 * s_last_b + n[None, :, None] * 2 + d64[:, None, :] * s_last_d
            tl.store(last_nd, h[0].to(last_ptr.dtype.element_ty), mask=mask_nd)
            tl.store(last_nd + 1, h[1].to(last_ptr.dtype.element_ty), mask=mask_nd)
        else:
            tl.store(last_ptr + b64 * s_last_b + n[None, :, None] + d64[:, None, :] * s_last_d,
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
        B_VARIABLE: tl.constexpr, C_VARIABLE: tl.constexpr, STORE_OUT_Z: tl.constexpr, R: tl.constexpr,
        L: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
        part_ptr=None, ofs_dA=0, ofs_dB=0, ofs_dC=0, ofs_dD=0, ofs_ddb=0, DETERMINISTIC: tl.constexpr = False,
        COMPLEX: tl.constexpr = False):
    # DETERMINISTIC: part_ptr is the float32 partials workspace (``bwd_partials_layout``); each sum
    # over programs goes to this program's own slot there instead of an atomic. COMPLEX: A, B, C, the
    # states, the adjoint and the complex sums are (re, im) pairs (the module docstring). The real
    # build's statements stay in their order (helpers and reordering change its code).
    b64 = tl.program_id(1).to(tl.int64)
    d, d64, mask_d, n, mask_n, steps, group, mask_nd = _program_tiles(dim, dstate, dim_per_group, R, L, BLOCK_N,
                                                                      CHUNK)

    A_nd = A_ptr + n[None, :, None] * s_A_n + d64[:, None, :] * s_A_d
    if COMPLEX:
        A = (tl.load(A_nd, mask=mask_nd, other=0.0).to(tl.float32),
             tl.load(A_nd + 1, mask=mask_nd, other=0.0).to(tl.float32))
        A2 = (A[0] * _LOG2E, A[1])
    else:
        A = tl.load(A_nd, mask=mask_nd, other=0.0).to(tl.float32)
        A2 = A * _LOG2E
    if HAS_DELTA_BIAS:
        bias = tl.load(delta_bias_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    else:
        bias = None
    if HAS_D:
        Dv = tl.load(D_ptr + d, mask=mask_d, other=0.0).to(tl.float32)
    u_col = u_ptr + b64 * s_u_b + d64 * s_u_d
    dt_col = delta_ptr + b64 * s_dt_b + d64 * s_dt_d
    do_col = dout_ptr + b64 * s_do_b + d64 * s_do_d
    if HAS_Z:
        z_col = z_ptr + b64 * s_z_b + d64 * s_z_d
    else:
        z_col = do_col  # z tiles are then loaded and never read: the compiler drops the loads
    st_nd = states_ptr + b64 * s_st_b + n[None, :, None] * s_st_n + d64[:, None, :]
    work_nd = work_ptr + b64 * s_w_b + n[None, :, None] * s_w_n + d64[:, None, :]

    if COMPLEX:
        zeros = tl.zeros([R, BLOCK_N, L], dtype=tl.float32)
        g_next, decay_next = (zeros, zeros), (zeros, zeros)
        dA_acc, dB_acc, dC_acc = (zeros, zeros), (zeros, zeros), (zeros, zeros)
    else:
        g_next = tl.zeros([R, BLOCK_N, L], dtype=tl.float32)  # adjoint at the next chunk's first step
        decay_next = tl.zeros([R, BLOCK_N, L], dtype=tl.float32)  # exp(dt A) there (any value at the end)
        dA_acc = tl.zeros([R, BLOCK_N, L], dtype=tl.float32)
        dB_acc = tl.zeros([R, BLOCK_N, L], dtype=tl.float32)
        dC_acc = tl.zeros([R, BLOCK_N, L], dtype=tl.float32)
    dD_acc = tl.zeros([R, L], dtype=tl.float32)
    ddb_acc = tl.zeros([R, L], dtype=tl.float32)
    if DETERMINISTIC:  # input-dependent dB/dC: one [dstate, seqlen] row (complex: [dstate, seqlen, 2]) per
        # (batch, block of dims)
        if COMPLEX:
            part_n = 2 * seqlen
        else:
            part_n = seqlen
        bc_row = (b64 * tl.num_programs(0) + tl.program_id(0)) * dstate * part_n
    else:
        part_n = None
        bc_row = None
    for si in range(num_segments):
        seg = num_segments - 1 - si
        # pass 1: the segment's chunk-start states, from the state saved at the previous segment's end.
        # Both passes load each chunk's tiles one chunk ahead (overlapping the loads with the scan).
        c0 = seg * seg_chunks
        if COMPLEX:
            h = _load_pair(st_nd + (seg - 1) * s_st_s, mask_nd & (seg > 0), dstate * s_st_n)
            _store_pair(work_nd, h, mask_nd, dstate * s_w_n)
        else:
            h = tl.load(st_nd + (seg - 1) * s_st_s, mask=mask_nd & (seg > 0), other=0.0)
            tl.store(work_nd, h, mask=mask_nd)
        u_raw, delta_raw, B_raw = _chunk_inputs(c0, u_col, dt_col, B_ptr, b64, group, d64, n, steps, mask_d, mask_n,
                                                seqlen, s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l,
                                                B_VARIABLE, CHUNK, COMPLEX)
        for k in range(seg_chunks - 1):  # the segment's last chunk ends no chunk of it
            _, _, mask = _chunk_steps(c0 + k, steps, mask_d, seqlen, CHUNK)
            u_cur, delta_cur, B_cur = u_raw, delta_raw, B_raw
            u_raw, delta_raw, B_raw = _chunk_inputs(c0 + k + 1, u_col, dt_col, B_ptr, b64, group, d64, n, steps,
                                                    mask_d, mask_n, seqlen, s_u_l, s_dt_l, s_B_b, s_B_g, s_B_d, s_B_n,
                                                    s_B_l, B_VARIABLE, CHUNK, COMPLEX)
            hs, _, _, _, _, _, _, _ = _chunk_states(h, u_cur, delta_cur, B_cur, mask, steps, A2, bias, HAS_DELTA_BIAS,
                                                    DELTA_SOFTPLUS, B_VARIABLE, COMPLEX)
            h = _steps(hs, steps, CHUNK - 1, COMPLEX)
            if COMPLEX:
                _store_pair(work_nd + (k + 1) * s_w_k, h, mask_nd, dstate * s_w_n)
            else:
                tl.store(work_nd + (k + 1) * s_w_k, h, mask=mask_nd)
        tl.debug_barrier()  # the workspace rows are read back by other threads
        # pass 2: the segment's chunks in reverse (chunks past the end are fully masked no-ops)
        tiles = _chunk_tiles(c0 + seg_chunks - 1, u_col, dt_col, z_col, do_col, B_ptr, C_ptr, b64, group, d64, n,
                             steps, mask_d, mask_n, seqlen, s_u_l, s_dt_l, s_z_l, s_do_l, s_B_b, s_B_g, s_B_d, s_B_n,
                             s_B_l, s_C_b, s_C_g, s_C_d, s_C_n, s_C_l, B_VARIABLE, C_VARIABLE, CHUNK, COMPLEX)
        if COMPLEX:
            h0_next = _load_pair(work_nd + (seg_chunks - 1) * s_w_k, mask_nd, dstate * s_w_n)
        else:
            h0_next = tl.load(work_nd + (seg_chunks - 1) * s_w_k, mask=mask_nd, other=0.0)
        for kk in range(seg_chunks):
            k = seg_chunks - 1 - kk
            c = c0 + k
            t64, mask_t, mask = _chunk_steps(c, steps, mask_d, seqlen, CHUNK)
            cur, h0 = tiles, h0_next
            tiles = _chunk_tiles(c - 1, u_col, dt_col, z_col, do_col, B_ptr, C_ptr, b64, group, d64, n, steps, mask_d,
                                 mask_n, seqlen, s_u_l, s_dt_l, s_z_l, s_do_l, s_B_b, s_B_g, s_B_d, s_B_n, s_B_l, s_C_b,
                                 s_C_g, s_C_d, s_C_n, s_C_l, B_VARIABLE, C_VARIABLE, CHUNK, COMPLEX)
            if COMPLEX:
                h0_next = _load_pair(work_nd + (k - 1) * s_w_k, mask_nd & (k > 0), dstate * s_w_n)
            else:
                h0_next = tl.load(work_nd + (k - 1) * s_w_k, mask=mask_nd & (k > 0), other=0.0)
            u_cur, delta_cur, B_cur, C_cur, z_cur, dout_cur = cur
            hs, decay, u, dt, raw, Bt, dtu, dBu = _chunk_states(h0, u_cur, delta_cur, B_cur, mask, steps, A2, bias,
                                                                HAS_DELTA_BIAS, DELTA_SOFTPLUS, B_VARIABLE, COMPLEX)
            Ct = _bc_tiles(C_cur, C_VARIABLE, COMPLEX)
            dout = dout_cur.to(tl.float32)
            if HAS_Z:
                y = _out_terms(hs, Ct, COMPLEX)
                if HAS_D:
                    y += Dv[None, :, :] * u
                zv = z_cur.to(tl.float32)
                sig = _sigmoid(zv)
                tl.store(dz_ptr + b64 * s_dz_b + d64[None, :, :] * s_dz_d + t64[:, None, None] * s_dz_l,
                         (dout * y * sig * (1.0 + zv * (1.0 - sig))).to(dz_ptr.dtype.element_ty), mask=mask)
                if STORE_OUT_Z:
                    tl.store(out_z_ptr + b64 * s_oz_b + d64[None, :, :] * s_oz_d + t64[:, None, None] * s_oz_l,
                             (y * zv * sig).to(out_z_ptr.dtype.element_ty), mask=mask)
                dy = dout * zv * sig
            else:
                dy = dout

            # adjoint g_t = C_t dy_t + exp(dt_{t+1} A) g_{t+1}, carried in from the next chunk
            # reversed, the decay of step t + 1 is the previous step's
            # with gB = sum_n g B and q = g exp(dt A) h_{t-1}: du = dt gB, ddt = u gB + sum_n A q, dA = sum_t dt q
            if COMPLEX:  # g = conj(dL/dh) from y's 2 Re(C h): input 2 dy C; gB = sum_n Re(g B), ddt's Re(q A)
                dy2 = 2.0 * dy
                g = _reverse_scan_complex(g_next, decay, decay_next, Ct, dy2, steps)
                g_next = _steps(g, steps, 0, COMPLEX)
                decay_next = _steps(decay, steps, 0, COMPLEX)
                gB = tl.sum(g[0] * Bt[0] - g[1] * Bt[1], axis=2)
                p_re, p_im = hs[0] - dBu[0], hs[1] - dBu[1]
                q = (g[0] * p_re - g[1] * p_im, g[0] * p_im + g[1] * p_re)
            else:
                decay_rev = tl.flip(decay, 0)
                g = tl.flip(_scan_from(g_next, _previous_steps(decay_rev, decay_next),
                                       tl.flip(Ct * dy[:, :, None, :], 0), steps), 0)
                g_next = _step(g, steps, 0)
                decay_next = _step(decay, steps, 0)
                gB = tl.sum(g * Bt, axis=2)
                q = g * (hs - dBu)
            du = dt * gB
            if HAS_D:
                du += Dv[None, :, :] * dy
                dD_acc += tl.sum(dy * u, axis=0)
            if COMPLEX:
                ddt = u * gB + tl.sum(q[0] * A[0][None, :, :, :] - q[1] * A[1][None, :, :, :], axis=2)
            else:
                ddt = u * gB + tl.sum(q * A[None, :, :, :], axis=2)
            if DELTA_SOFTPLUS:
                ddt = tl.where(raw <= 20.0, ddt * _sigmoid(raw), ddt)
            ddt = tl.where(mask, ddt, 0.0)
            tl.store(du_ptr + b64 * s_du_b + d64[None, :, :] * s_du_d + t64[:, None, None] * s_du_l,
                     du.to(du_ptr.dtype.element_ty), mask=mask)
            tl.store(ddelta_ptr + b64 * s_ddt_b + d64[None, :, :] * s_ddt_d + t64[:, None, None] * s_ddt_l,
                     ddt.to(ddelta_ptr.dtype.element_ty), mask=mask)
            if HAS_DELTA_BIAS:
                ddb_acc += tl.sum(ddt, axis=0)

            if COMPLEX:  # dA = dt conj(q), dB = dt u conj(g), dC = 2 dy conj(h): parts at [..., t, 0 / 1]
                dA_acc = (dA_acc[0] + tl.sum(q[0] * dt[:, :, None, :], axis=0),
                          dA_acc[1] - tl.sum(q[1] * dt[:, :, None, :], axis=0))
            else:
                dA_acc += tl.sum(q * dt[:, :, None, :], axis=0)

            mask_tn = mask_t[:, None] & mask_n[None, :]
            if COMPLEX:
                dB_acc = (_bc_grad(dB_acc[0], g[0], dtu, part_ptr, ofs_dB, bc_row, part_n, 2 * t64, dB_ptr, b64,
                                   s_dB_b, group, s_dB_g, t64, s_dB_l, n, s_dB_n, mask_tn, B_VARIABLE, DETERMINISTIC),
                          _bc_grad(dB_acc[1], -g[1], dtu, part_ptr, ofs_dB, bc_row, part_n, 2 * t64 + 1, dB_ptr + 1,
                                   b64, s_dB_b, group, s_dB_g, t64, s_dB_l, n, s_dB_n, mask_tn, B_VARIABLE,
                                   DETERMINISTIC))
                dC_acc = (_bc_grad(dC_acc[0], hs[0], dy2, part_ptr, ofs_dC, bc_row, part_n, 2 * t64, dC_ptr, b64,
                                   s_dC_b, group, s_dC_g, t64, s_dC_l, n, s_dC_n, mask_tn, C_VARIABLE, DETERMINISTIC),
                          _bc_grad(dC_acc[1], -hs[1], dy2, part_ptr, ofs_dC, bc_row, part_n, 2 * t64 + 1, dC_ptr + 1,
                                   b64, s_dC_b, group, s_dC_g, t64, s_dC_l, n, s_dC_n, mask_tn, C_VARIABLE,
                                   DETERMINISTIC))
            else:
                dB_acc = _bc_grad(dB_acc, g, dtu, part_ptr, ofs_dB, bc_row, part_n, t64, dB_ptr, b64, s_dB_b, group,
                                  s_dB_g, t64, s_dB_l, n, s_dB_n, mask_tn, B_VARIABLE, DETERMINISTIC)
                dC_acc = _bc_grad(dC_acc, hs, dy, part_ptr, ofs_dC, bc_row, part_n, t64, dC_ptr, b64, s_dC_b, group,
                                  s_dC_g, t64, s_dC_l, n, s_dC_n, mask_tn, C_VARIABLE, DETERMINISTIC)
        tl.debug_barrier()  # pass 1 of the previous segment overwrites the workspace

    # the sums over programs: per batch row into its own slot of the partials (deterministic: one
    # [dim, dstate] or [dim] slot a row), else atomically into the gradients
    if COMPLEX:  # dA and fixed dB/dC as [dim, dstate, 2] (re, im) pairs
        nd = n[None, :, None] * 2 + d64[:, None, :] * (2 * dstate)
        if DETERMINISTIC:
            slot = b64 * dim * dstate * 2
            dA_nd = part_ptr + ofs_dA + slot + nd
            dB_nd = part_ptr + ofs_dB + slot + nd
            dC_nd = part_ptr + ofs_dC + slot + nd
        else:
            dA_nd = dA_ptr + nd
            dB_nd = dB_ptr + n[None, :, None] * s_dB_n + d64[:, None, :] * s_dB_d
            dC_nd = dC_ptr + n[None, :, None] * s_dC_n + d64[:, None, :] * s_dC_d
        _put_pair(dA_nd, dA_acc, mask_nd, DETERMINISTIC)
        if not B_VARIABLE:
            _put_pair(dB_nd, dB_acc, mask_nd, DETERMINISTIC)
        if not C_VARIABLE:
            _put_pair(dC_nd, dC_acc, mask_nd, DETERMINISTIC)
    elif DETERMINISTIC:
        nd = n[None, :, None] + d64[:, None, :] * dstate
        tl.store(part_ptr + ofs_dA + b64 * dim * dstate + nd, dA_acc, mask=mask_nd)
        if not B_VARIABLE:
            tl.store(part_ptr + ofs_dB + b64 * dim * dstate + nd, dB_acc, mask=mask_nd)
        if not C_VARIABLE:
            tl.store(part_ptr + ofs_dC + b64 * dim * dstate + nd, dC_acc, mask=mask_nd)
    else:
        tl.atomic_add(dA_ptr + n[None, :, None] + d64[:, None, :] * dstate, dA_acc, mask=mask_nd, sem="relaxed")
        if not B_VARIABLE:
            tl.atomic_add(dB_ptr + n[None, :, None] * s_dB_n + d64[:, None, :] * s_dB_d, dB_acc, mask=mask_nd,
                          sem="relaxed")
        if not C_VARIABLE:
            tl.atomic_add(dC_ptr + n[None, :, None] * s_dC_n + d64[:, None, :] * s_dC_d, dC_acc, mask=mask_nd,
                          sem="relaxed")
    if DETERMINISTIC:
        if HAS_D:
            tl.store(part_ptr + ofs_dD + b64 * dim + d, dD_acc, mask=mask_d)
        if HAS_DELTA_BIAS:
            tl.store(part_ptr + ofs_ddb + b64 * dim + d, ddb_acc, mask=mask_d)
    else:
        if HAS_D:
            tl.atomic_add(dD_ptr + d, dD_acc, mask=mask_d, sem="relaxed")
        if HAS_DELTA_BIAS:
            tl.atomic_add(ddelta_bias_ptr + d, ddb_acc, mask=mask_d, sem="relaxed")


# ----------------------------------------------------------------------------------------------
# launchers

CHUNK = 8  # steps each thread of the forward scans in registers; the backward, half as many
# State elements (steps x in-thread states x in-thread dims) a thread holds per tile: the winners of
# an H200 sweep at the benchmark shape (benchmarks/NOTES.md), forward 32 dims a program, backward 16
# dims, 2 of them in each thread, 4 steps a chunk. The backward's sums over dims add the in-thread
# pairs before shuffling.
FWD_ELEMS_PER_THREAD = 128
BWD_ELEMS_PER_THREAD = 32
BWD_DIM_REGS = 2


class ScanPlan(NamedTuple):
    """How seqlen is cut: the forward scans chunks of ``chunk`` steps (one scan in registers), grouped
    in segments of ``seg_chunks`` chunks, and saves the state at each segment's end. The backward
    walks the segments in chunks of ``bwd_chunk`` steps (dividing ``chunk``): it recomputes a
    segment's chunk-start states into a workspace, then walks its chunks in reverse. ``seg_chunks``
    about sqrt(n_chunks) balances the saved states against the workspace."""
    chunk: int
    seg_chunks: int
    n_chunks: int
    n_segments: int
    bwd_chunk: int

    @property
    def bwd_seg_chunks(self) -> int:
        """Backward chunks a segment."""
        return self.seg_chunks * self.chunk // self.bwd_chunk


def scan_plan(seqlen: int, chunk=None, seg_chunks=None, bwd_chunk=None) -> ScanPlan:
    chunk = chunk or min(CHUNK, triton.next_power_of_2(max(seqlen, 1)))
    if chunk < 1 or chunk & (chunk - 1):
        raise ValueError(f"chunk: expected a power of two, got {chunk}")
    bwd_chunk = bwd_chunk or max(1, chunk // 2)
    if bwd_chunk < 1 or bwd_chunk & (bwd_chunk - 1) or bwd_chunk > chunk:
        raise ValueError(f"bwd_chunk: expected a power of two dividing chunk = {chunk}, got {bwd_chunk}")
    n_chunks = max(1, triton.cdiv(seqlen, chunk))
    seg_chunks = seg_chunks or math.isqrt(n_chunks - 1) + 1
    if seg_chunks < 1:
        raise ValueError(f"seg_chunks: expected >= 1, got {seg_chunks}")
    seg_chunks = min(seg_chunks, n_chunks)
    return ScanPlan(chunk, seg_chunks, n_chunks, triton.cdiv(n_chunks, seg_chunks), bwd_chunk)


def states_shape(batch: int, dim: int, dstate: int, plan: ScanPlan, complex_A: bool = False):
    """The float32 segment-end states the forward saves for the backward (contiguous); for complex A
    with a (re, im) plane axis before dstate."""
    return (batch, plan.n_segments) + ((2,) if complex_A else ()) + (dstate, dim)


def workspace_shape(batch: int, dim: int, dstate: int, plan: ScanPlan, complex_A: bool = False):
    """The float32 workspace of the backward (contiguous): one segment's chunk-start states (planes as
    ``states_shape``'s)."""
    return (batch, plan.bwd_seg_chunks) + ((2,) if complex_A else ()) + (dstate, dim)


def bc_layout(name: str, t, batch: int, dim: int, dstate: int, seqlen: int, pairs: bool = False):
    """(variable, groups, strides (b, g, d, n, l)) of B or C; a [b, n, l] tensor is one group. With
    ``pairs`` (complex A) the same shapes with a trailing (re, im) axis of 2, which must have stride 1."""
    dims, st = T.shape(t), T.strides(t)
    tail = (2,) if pairs else ()
    if pairs:
        if len(dims) not in (3, 4, 5) or dims[-1] != 2 or st[-1] != 1:
            raise ValueError(f"{name}: expected (re, im) pairs [dim, dstate, 2], [batch, dstate, seqlen, 2] or "
                             f"[batch, groups, dstate, seqlen, 2] with the last axis contiguous (complex A), got "
                             f"shape {dims}, strides {st}")
        dims, st = dims[:-1], st[:-1]
    if len(dims) == 2:
        if dims != (dim, dstate):
            raise ValueError(f"{name}: expected shape {(dim, dstate) + tail}, got {T.shape(t)}")
        return False, 1, (0, 0, st[0], st[1], 0)
    if len(dims) == 3:
        if dims != (batch, dstate, seqlen):
            raise ValueError(f"{name}: expected shape {(batch, dstate, seqlen) + tail}, got {T.shape(t)}")
        return True, 1, (st[0], 0, 0, st[1], st[2])
    if len(dims) == 4:
        if dims[0] != batch or dims[2:] != (dstate, seqlen) or dims[1] < 1 or dim % dims[1]:
            raise ValueError(f"{name}: expected [batch={batch}, groups dividing dim={dim}, dstate={dstate}, "
                             f"seqlen={seqlen}{', 2' if pairs else ''}], got {T.shape(t)}")
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


def check_optional_grads(dim, z, dz, out_z, D, dD, delta_bias, ddelta_bias) -> None:
    """The backward's optional outputs, both backends: dz exactly with z, out_z only with z, dD /
    ddelta_bias exactly with D / delta_bias (float32 contiguous [dim])."""
    if (z is None) != (dz is None):
        raise ValueError("dz: expected exactly when z is given")
    if out_z is not None and z is None:
        raise ValueError("out_z: the recomputed output is only written when z is given")
    for name, t, given, what in (("dD", dD, D, "D"), ("ddelta_bias", ddelta_bias, delta_bias, "delta_bias")):
        if (t is None) != (given is None):
            raise ValueError(f"{name}: expected exactly when {what} is given")
        if t is not None:
            _check_f32_buffer(name, t, (dim,))


def _strides3(t):
    return T.strides(t) if t is not None else (0, 0, 0)


def _state_strides(t):
    """(batch, segment or chunk, dstate) strides of states or workspace (complex A's plane axis skipped)."""
    st = T.strides(t)
    return st[0], st[1], st[-2]


def _blocks(dim, dstate, groups, chunk, elems_per_thread, block_d=None, num_warps=None, dim_regs=1,
            complex_A=False):
    """(R, L, BLOCK_N, num_warps) of [chunk, R, BLOCK_N, L] tiles: BLOCK_D = R * L dims (``block_d``),
    L of them across the lanes, R in each thread (at most ``dim_regs``), about ``elems_per_thread``
    state elements in each thread (half as many for complex A: each is a pair); a block of dims stays
    inside one group."""
    if complex_A:
        elems_per_thread //= 2
    block_n = triton.next_power_of_2(dstate)
    dim_per_group = dim // groups
    if block_d is None:
        block_d = max(1, min(32 * elems_per_thread // (chunk * block_n), triton.next_power_of_2(dim)))
        if groups > 1:
            block_d = min(block_d, dim_per_group & -dim_per_group)
    elif block_d < 1 or block_d & (block_d - 1) or (groups > 1 and dim_per_group % block_d):
        raise ValueError(f"block_d: expected a power of two dividing dim / groups = {dim_per_group}, got {block_d}")
    if dim_regs < 1 or dim_regs & (dim_regs - 1):
        raise ValueError(f"dim_regs: expected a power of two, got {dim_regs}")
    regs = min(dim_regs, block_d)
    lanes = block_d // regs
    return regs, lanes, block_n, num_warps or max(1, min(4, lanes // 32))


def is_complex_A(A) -> bool:
    """Whether A is complex: given as (re, im) pairs [dim, dstate, 2]."""
    return len(T.shape(A)) == 3


def _scan_args(u, delta, A, B, C, D, z, delta_bias):
    """Shapes checked; (batch, dim, seqlen, dstate, groups, B layout, C layout, complex A)."""
    if len(T.shape(u)) != 3:
        raise ValueError(f"u: expected [batch, dim, seqlen], got shape {T.shape(u)}")
    batch, dim, seqlen = T.shape(u)
    complex_A = is_complex_A(A)
    if len(T.shape(A)) not in (2, 3) or T.shape(A)[0] != dim or \
            (complex_A and (T.shape(A)[2] != 2 or T.strides(A)[2] != 1)):
        raise ValueError(f"A: expected [dim={dim}, dstate] (real) or [dim={dim}, dstate, 2] (complex: (re, im) "
                         f"pairs, the last axis contiguous), got shape {T.shape(A)}, strides {T.strides(A)}")
    dstate = T.shape(A)[1]
    for name, t in (("delta", delta), ("z", z)):
        _check_seq(name, t, batch, dim, seqlen)
    _check_vec("D", D, dim)
    _check_vec("delta_bias", delta_bias, dim)
    B_lay = bc_layout("B", B, batch, dim, dstate, seqlen, complex_A)
    C_lay = bc_layout("C", C, batch, dim, dstate, seqlen, complex_A)
    return batch, dim, seqlen, dstate, _groups(B_lay, C_lay), B_lay, C_lay, complex_A


def selective_scan_fwd(u, delta, A, B, C, out, D=None, z=None, delta_bias=None, states=None, last_state=None,
                       delta_softplus: bool = False, plan: ScanPlan | None = None, block_d=None,
                       num_warps=None) -> None:
    """out[b, d, l] = the scan (gated by silu(z) when z is given), written in place; also the
    float32 segment-end ``states`` (``states_shape(..., plan, complex A)``) the backward needs, and
    ``last_state`` [b, d, n] (complex A: [b, d, n, 2] with the last two axes contiguous), each when
    given. ``plan`` (default ``scan_plan(seqlen)``) must be passed unchanged to the backward. Complex
    A and its B, C as (re, im) pairs: the module docstring."""
    batch, dim, seqlen, dstate, groups, B_lay, C_lay, complex_A = _scan_args(u, delta, A, B, C, D, z, delta_bias)
    _check_seq("out", out, batch, dim, seqlen)
    plan = plan or scan_plan(seqlen)
    regs, lanes, block_n, num_warps = _blocks(dim, dstate, groups, plan.chunk, FWD_ELEMS_PER_THREAD, block_d,
                                              num_warps, complex_A=complex_A)
    if states is not None:
        _check_f32_buffer("states", states, states_shape(batch, dim, dstate, plan, complex_A))
    if last_state is not None:
        T.check_same_shape("last_state", last_state, (batch, dim, dstate) + ((2,) if complex_A else ()))
        if T.strides(last_state)[2:] != ((2, 1) if complex_A else (1,)):
            raise ValueError(f"last_state: last axis must be contiguous{' (and hold (re, im) pairs)' * complex_A}, "
                             f"got strides {T.strides(last_state)}")
    if batch * dim * seqlen == 0:
        return
    st_st = _state_strides(states) if states is not None else (0, 0, 0)
    last_st = T.strides(last_state)[:2] if last_state is not None else (0, 0)
    _selective_scan_fwd_kernel[(triton.cdiv(dim, regs * lanes), batch)](
        u, delta, A, B, C, D, z, delta_bias, out, states, last_state,
        dim, seqlen, dstate, dim // groups, plan.n_chunks, plan.seg_chunks,
        *T.strides(u), *T.strides(delta), *T.strides(A)[:2], *B_lay[2], *C_lay[2],
        *_strides3(z), *T.strides(out), *st_st, *last_st,
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=bool(delta_softplus), B_VARIABLE=B_lay[0], C_VARIABLE=C_lay[0],
        STORE_STATES=states is not None, STORE_LAST=last_state is not None,
        R=regs, L=lanes, BLOCK_N=block_n, CHUNK=plan.chunk, COMPLEX=complex_A, num_warps=num_warps)


def bwd_partials_layout(u, A, B, C, D=None, delta_bias=None, plan: ScanPlan | None = None, block_d=None,
                        dim_regs=BWD_DIM_REGS) -> dict:
    """Where a deterministic backward puts its per-program sums in the float32 ``partials`` workspace
    of ``selective_scan_bwd``: {gradient: (offset, parts, inner, outer)}, each a contiguous
    ``[outer, parts, inner]`` block, and "numel" (the workspace's size). dA, fixed dB/dC, dD and
    ddelta_bias take one slot per batch row (``batch * dim * dstate`` or ``batch * dim`` floats);
    an input-dependent dB/dC one ``[dstate, seqlen]`` row per (batch, block of dims): (dim /
    block_d) times its own size. Complex A: the complex sums take (re, im) pairs, twice the floats."""
    batch, dim, seqlen = T.shape(u)
    dstate = T.shape(A)[1]
    complex_A = is_complex_A(A)
    B_lay = bc_layout("B", B, batch, dim, dstate, seqlen, complex_A)
    C_lay = bc_layout("C", C, batch, dim, dstate, seqlen, complex_A)
    groups = _groups(B_lay, C_lay)
    plan = plan or scan_plan(seqlen)
    regs, lanes, _, _ = _blocks(dim, dstate, groups, plan.bwd_chunk, BWD_ELEMS_PER_THREAD, block_d, None, dim_regs,
                                complex_A)
    dim_blocks = triton.cdiv(dim, regs * lanes)
    pair = 2 if complex_A else 1
    layout, numel = {}, 0
    sections = [("dA", batch, dim * dstate * pair, 1)]
    for name, lay in (("dB", B_lay), ("dC", C_lay)):
        # variable: the dim blocks of a group are its parts ([batch * groups, blocks a group, ...])
        sections.append((name, dim_blocks // groups, dstate * seqlen * pair, batch * groups) if lay[0]
                        else (name, batch, dim * dstate * pair, 1))
    sections += [(name, batch, dim, 1) for name, t in (("dD", D), ("ddelta_bias", delta_bias)) if t is not None]
    for name, parts, inner, outer in sections:
        layout[name] = (numel, parts, inner, outer)
        numel += outer * parts * inner
    layout["numel"] = numel
    return layout


def selective_scan_bwd(u, delta, A, B, C, dout, states, workspace, du, ddelta, dA, dB, dC, D=None, z=None,
                       delta_bias=None, dD=None, dz=None, ddelta_bias=None, out_z=None,
                       delta_softplus: bool = False, plan: ScanPlan | None = None, block_d=None,
                       num_warps=None, dim_regs=BWD_DIM_REGS, partials=None) -> None:
    """Gradients of the scan. Written in place: du, ddelta [b, d, l], dz (when z is given) and
    out_z = the forward output recomputed (optional, with z). Accumulated (+=, float32, the caller
    zeroes them): dA [d, n] contiguous, dB/dC shaped like B/C, dD and ddelta_bias [d] (when D /
    delta_bias are given); complex A: dA [d, n, 2] contiguous, dB/dC (re, im) pairs shaped like
    B/C. ``states`` and ``plan`` are the forward's; ``workspace`` is float32 ``workspace_shape(...,
    plan, complex A)``. ``partials`` (float32 contiguous ``[bwd_partials_layout(...)["numel"]]``,
    contents ignored) makes the accumulated gradients deterministic: per-program sums there, then
    added in a fixed order, instead of fp32 atomics (dB/dC must then be contiguous)."""
    batch, dim, seqlen, dstate, groups, B_lay, C_lay, complex_A = _scan_args(u, delta, A, B, C, D, z, delta_bias)
    for name, t in (("dout", dout), ("du", du), ("ddelta", ddelta), ("dz", dz), ("out_z", out_z)):
        _check_seq(name, t, batch, dim, seqlen)
    check_optional_grads(dim, z, dz, out_z, D, dD, delta_bias, ddelta_bias)
    _check_f32_buffer("dA", dA, (dim, dstate) + ((2,) if complex_A else ()))
    dB_lay = bc_layout("dB", dB, batch, dim, dstate, seqlen, complex_A)
    dC_lay = bc_layout("dC", dC, batch, dim, dstate, seqlen, complex_A)
    for name, t, like in (("dB", dB, B), ("dC", dC, C)):
        T.check_same_shape(name, t, T.shape(like))
        if T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected a float32 accumulator, got {T.dtype_name(t)}")
    plan = plan or scan_plan(seqlen)
    regs, lanes, block_n, num_warps = _blocks(dim, dstate, groups, plan.bwd_chunk, BWD_ELEMS_PER_THREAD, block_d,
                                              num_warps, dim_regs, complex_A)
    _check_f32_buffer("states", states, states_shape(batch, dim, dstate, plan, complex_A))
    _check_f32_buffer("workspace", workspace, workspace_shape(batch, dim, dstate, plan, complex_A))
    flags = {}  # the default build stays as it was
    if partials is not None:
        layout = bwd_partials_layout(u, A, B, C, D, delta_bias, plan, block_d, dim_regs)
        _check_f32_buffer("partials", partials, (layout["numel"],))
        for name, t in (("dB", dB), ("dC", dC)):
            T.check_contiguous(name, t)
        flags = dict(part_ptr=partials, ofs_dA=layout["dA"][0], ofs_dB=layout["dB"][0], ofs_dC=layout["dC"][0],
                     ofs_dD=layout.get("dD", (0,))[0], ofs_ddb=layout.get("ddelta_bias", (0,))[0],
                     DETERMINISTIC=True)
    if batch * dim * seqlen == 0:
        return
    _selective_scan_bwd_kernel[(triton.cdiv(dim, regs * lanes), batch)](
        u, delta, A, B, C, D, z, delta_bias, dout, states, workspace,
        du, ddelta, dA, dB, dC, dD, dz, ddelta_bias, out_z,
        dim, seqlen, dstate, dim // groups, plan.n_segments, plan.bwd_seg_chunks,
        *T.strides(u), *T.strides(delta), *T.strides(A)[:2], *B_lay[2], *C_lay[2],
        *_strides3(z), *T.strides(dout), *_state_strides(states), *_state_strides(workspace),
        *T.strides(du), *T.strides(ddelta), *_strides3(dz), *_strides3(out_z), *dB_lay[2], *dC_lay[2],
        HAS_D=D is not None, HAS_Z=z is not None, HAS_DELTA_BIAS=delta_bias is not None,
        DELTA_SOFTPLUS=bool(delta_softplus), B_VARIABLE=B_lay[0], C_VARIABLE=C_lay[0],
        STORE_OUT_Z=out_z is not None, R=regs, L=lanes, BLOCK_N=block_n,
        CHUNK=plan.bwd_chunk, COMPLEX=complex_A, num_warps=num_warps, **flags)
    if partials is not None:
        for name, grad in (("dA", dA), ("dB", dB), ("dC", dC), ("dD", dD), ("ddelta_bias", ddelta_bias)):
            if grad is not None:
                offset, parts, inner, outer = layout[name]
                add_parts(partials, grad, parts, inner, outer, part_offset=offset)


def compile_cases():
    """The canonical case (variable B/C, D, z, delta_bias, softplus) in each dtype, the fixed-B/C,
    grouped and plain (no D/z/bias) variants in bf16, complex A with variable (bf16) and fixed (fp32)
    B/C; the deterministic backward (variable, fixed and complex variable B/C) in bf16."""
    S = T.SpecTensor
    batch, dim, seqlen, dstate = 8, 4096, 2048, 16
    plan = scan_plan(seqlen)
    cases = [(dtype, "variable") for dtype in T.FLOAT_DTYPES] + \
        [("bfloat16", kind) for kind in ("fixed", "grouped", "plain", "complex")] + [("float32", "complex-fixed")]
    for dtype, kind in cases:
        complex_A = kind.startswith("complex")
        pair = (2,) if complex_A else ()  # complex tensors as (re, im) pairs
        u, delta, z, out, du, ddelta, dz = (S((batch, dim, seqlen), dtype) for _ in range(7))
        if kind in ("fixed", "complex-fixed"):
            Bs, Cs = S((dim, dstate) + pair, "float32"), S((dim, dstate) + pair, "float32")
        elif kind == "grouped":
            Bs, Cs = S((batch, 4, dstate, seqlen), dtype), S((batch, 4, dstate, seqlen), dtype)
        else:
            Bs, Cs = S((batch, dstate, seqlen) + pair, dtype), S((batch, dstate, seqlen) + pair, dtype)
        A, D, bias = S((dim, dstate) + pair, "float32"), S((dim,), "float32"), S((dim,), "float32")
        if kind == "plain":
            D = z = bias = dz = None
        states = S(states_shape(batch, dim, dstate, plan, complex_A), "float32")
        work = S(workspace_shape(batch, dim, dstate, plan, complex_A), "float32")
        last = S((batch, dim, dstate) + pair, "float32")
        dA, dB, dC = S(A.shape, "float32"), S(Bs.shape, "float32"), S(Cs.shape, "float32")
        dD, ddb = (S((dim,), "float32"), S((dim,), "float32")) if kind != "plain" else (None, None)
        yield f"selective_scan_fwd[{dtype},{kind}]", lambda a=(u, delta, A, Bs, Cs, out, D, z, bias, states, last): \
            selective_scan_fwd(*a, delta_softplus=kind != "plain")
        bwd_args = (u, delta, A, Bs, Cs, out, states, work, du, ddelta, dA, dB, dC, D, z, bias, dD, dz, ddb,
                    out if z is not None else None)
        yield f"selective_scan_bwd[{dtype},{kind}]", \
            lambda a=bwd_args: selective_scan_bwd(*a, delta_softplus=kind != "plain")
        if dtype == "bfloat16" and kind in ("variable", "fixed", "complex"):
            parts = S((bwd_partials_layout(u, A, Bs, Cs, D, bias, plan)["numel"],), "float32")
            yield f"selective_scan_bwd[{dtype},{kind},deterministic]", \
                lambda a=bwd_args, p=parts: selective_scan_bwd(*a, delta_softplus=True, partials=p)
