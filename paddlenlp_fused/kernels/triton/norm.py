"""LayerNorm, RMSNorm and Mamba-2's gated RMSNorm: forward and backward.

Shapes (M rows, N columns; 2-D tensors have a contiguous last axis and rows at any stride):
    x, y, dy, dx, z, dz                  [M, N]   activation dtype
    residual, residual_out, dresidual    [M, N]   each in its own float dtype
    weight, bias, dweight, dbias         [N]      fp32 or the activation dtype
    weight1, bias1, dweight1, dbias1     [N]      flash-attn's second output y1 [M, N] (and dy1)
    mean, rstd                           [M * ngroups] fp32, saved by the forward for the backward
    partials (backward workspace)        [n_sums, P, N] fp32: per program one row of partial sums of
                                          dweight (and dbias, dweight1, dbias1); ``bwd_workspace_shapes``
                                          gives P
    rowstats (backward workspace)        [M * ngroups, 2] fp32, only when a group is wider than one
                                          register block (``bwd_workspace_shapes`` says when)
    counters (backward workspace)        [COUNTERS] int32 zeros, optional: the fused partial sums

Each row is normalised in groups of G = group_size consecutive columns (G = N for the plain norms):
    h    = x (+ residual, rounded to residual_out's dtype, which is also stored)
           gated with norm_before_gate=False: h = x * silu(z)
    xhat = (h - mean) * rstd                (RMSNorm: mean = 0, rstd = 1 / sqrt(mean(h^2) + eps))
    y    = xhat * (weight + weight_offset) (+ bias); gated with norm_before_gate=True: y *= silu(z)
    y1   = xhat * (weight1 + weight_offset) (+ bias1), ungated, when weight1 is given

Memory-bound. The forward holds a [ROWS, BLOCK_N] tile of whole groups in registers (BLOCK_N up to
8192) and reads x once; wider groups loop over chunks (two or three sweeps, re-reads mostly from
L2). The backward runs a persistent grid of P programs per group and column slab (as many as fit
on the GPU at once): each walks row tiles pid, pid + P, ... in a ``tl.range`` loop that Triton
software-pipelines with ``num_stages`` (the next tiles' loads go to shared memory asynchronously
while the current tile is reduced), keeps its dweight/dbias sums in fp32 registers and writes one
partial row; a second small kernel sums the P partial rows. Given a ``counters`` workspace, rows
of one slab instead sum them in the same launch: a cooperative launch (all P programs resident),
a grid barrier on the counters, then each program sums a few columns of all P rows. Groups wider
than one backward block (8192) are split into column slabs, whose row reductions a pre-pass
computes (``rowstats``).

Launches go through ``DirectLauncher``, which calls the compiled kernel directly once Triton has
compiled it for a specialisation: the eager fwd+bwd was bound by Triton's per-launch host work.

The other loops with run-time trip counts are ``while`` loops (written when the interpreter could
not take a run-time ``range`` bound).
"""

from __future__ import annotations

import ctypes
import functools
from typing import NamedTuple, Optional

import triton
import triton.language as tl
from triton.runtime.jit import JITFunction

from ...runtime import tensor as T

COUNTERS = 2  # int32 workspace of the fused partial sums (arrivals, departures at the grid barrier)


# ----------------------------------------------------------------------------------------------
# tuning table: the launch configuration, apart from the kernels (measured choices: benchmarks/NOTES.md)


class FwdTuning(NamedTuple):
    """Forward tile: rows per program and warps; None takes the table's choice (``_fwd_config``)."""
    rows: Optional[int] = None
    num_warps: Optional[int] = None


class BwdTuning(NamedTuple):
    """Backward tile and loop: rows per program, warps, software-pipelining depth of the row loop,
    and whether the weight is re-read each row (from L1) or held in registers; None takes the
    table's choice (``_bwd_config``, ``_bwd_stages``)."""
    rows: Optional[int] = None
    num_warps: Optional[int] = None
    num_stages: Optional[int] = None
    reload_weight: bool = True


FWD_MAX_BLOCK = 8192  # widest group the forward keeps in registers (wider: chunks of 8192)
BWD_MAX_BLOCK = 8192  # widest column slab the backward keeps in registers (with its dw/db sums)
# Tiles of the partial sums: narrow column blocks, so that many programs share the P rows
_SUM_BLOCK_P, _SUM_BLOCK_N = 128, 16  # the separate partial-sum kernel
_FUSED_SUM_BLOCK_P, _FUSED_SUM_BLOCK_N = 128, 16  # the sums in the backward
_STAGE_BUFFER_BYTES = 128 * 1024  # shared memory the backward's pipelined loads may take


def _warps(elements: int) -> int:
    return 4 if elements <= 1024 else (8 if elements <= 4096 else 16)


@functools.lru_cache(maxsize=256)
def _fwd_config(G: int, max_block: int, rows=None, num_warps=None):
    """(ROWS, BLOCK_N, num_warps): groups up to 4096 wide go several to a program, in tiles of 8192
    elements on 8 warps; wider ones one per program on 16 warps. ``rows`` / ``num_warps``: a
    ``FwdTuning``'s overrides."""
    block_n = min(triton.next_power_of_2(G), max_block)
    if block_n <= 4096:
        return rows or max(1, min(32, 8192 // block_n)), block_n, num_warps or 8
    return rows or 1, block_n, num_warps or 16


@functools.lru_cache(maxsize=256)
def _bwd_config(G: int, max_block: int, rows=None, num_warps=None):
    """(ROWS, BLOCK_N, NUM_SLABS, num_warps); ``rows`` / ``num_warps``: a ``BwdTuning``'s overrides."""
    block_n = min(triton.next_power_of_2(G), max_block)
    slabs = triton.cdiv(G, block_n)
    rows = rows or (max(1, min(16, 2048 // block_n)) if slabs == 1 else 1)
    return rows, block_n, slabs, num_warps or _warps(rows * block_n)


def _bwd_stages(tile_elements: int) -> int:
    """Software-pipelining depth of the backward's row loop: 3 for tiles up to 4096 elements (2
    prefetch too little ahead for DRAM latency and pay the shared-memory round trip), none for
    the 8192-column tiles of wide rows (one program per SM, faster unpipelined)."""
    return 3 if tile_elements <= 4096 else 1


@triton.jit
def _silu_and_grad(z):
    s = 1.0 / (1.0 + tl.exp(-z))
    return z * s, s * (1.0 + z * (1.0 - s))


@triton.jit
def _dropout(t, keep, dropout_p):
    """Inverted dropout: kept values scaled by 1 / (1 - dropout_p)."""
    return tl.where(keep, t / (1.0 - dropout_p), 0.0)


@triton.jit
def _keep(seed, rows64, G, cols, dropout_p):
    """Dropout's keep-mask of a tile: Philox from the seed at element row * G + col, the same in
    the forward and the backward."""
    return tl.rand(seed, rows64 * G + cols) >= dropout_p


@triton.jit
def _fwd_load_h(x_ptr, res_ptr, z_ptr, res_out_ptr, rows64, col_base, cols, mask,
                stride_x, stride_res, stride_z, stride_res_out,
                x1_ptr, rs_ptr, mask_ptr, mask1_ptr, seed, dropout_p, stride_x1, stride_mask, G,
                HAS_RES: tl.constexpr, STORE_RES_OUT: tl.constexpr, HAS_Z: tl.constexpr,
                NORM_BEFORE_GATE: tl.constexpr, WRITE_RES_OUT: tl.constexpr,
                HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                STORE_MASK: tl.constexpr):
    """h of a [ROWS, BLOCK_N] tile in fp32; stores residual_out (and the keep-masks) when asked
    (first sweep only). flash-attn's extras: h = dropout(x * rowscale) + dropout(x1) + residual."""
    h = tl.load(x_ptr + rows64 * stride_x + col_base + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_ROWSCALE:
        h *= tl.load(rs_ptr + rows64 + 0 * cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_DROPOUT:
        keep = _keep(seed, rows64, G, cols, dropout_p)
        if STORE_MASK and WRITE_RES_OUT:
            tl.store(mask_ptr + rows64 * stride_mask + cols, keep.to(mask_ptr.dtype.element_ty), mask=mask)
        h = _dropout(h, keep, dropout_p)
    if HAS_X1:
        x1 = tl.load(x1_ptr + rows64 * stride_x1 + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep1 = _keep(seed + 1, rows64, G, cols, dropout_p)
            if STORE_MASK and WRITE_RES_OUT:
                tl.store(mask1_ptr + rows64 * stride_mask + cols, keep1.to(mask1_ptr.dtype.element_ty), mask=mask)
            x1 = _dropout(x1, keep1, dropout_p)
        h += x1
    if HAS_RES:
        h += tl.load(res_ptr + rows64 * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    if STORE_RES_OUT:
        rounded = h.to(res_out_ptr.dtype.element_ty)
        if WRITE_RES_OUT:
            tl.store(res_out_ptr + rows64 * stride_res_out + cols, rounded, mask=mask)
        h = rounded.to(tl.float32)  # normalise exactly what the backward will read back
    if HAS_Z:
        if not NORM_BEFORE_GATE:
            z = tl.load(z_ptr + rows64 * stride_z + col_base + cols, mask=mask, other=0.0).to(tl.float32)
            silu_z, _ = _silu_and_grad(z)
            h = h * silu_z
    return h


@triton.jit
def _fwd_store_y(h, mean, rstd, w_ptr, b_ptr, z_ptr, y_ptr, rows64, col_base, cols, mask, col_mask,
                 stride_z, stride_y, weight_offset,
                 HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    w = tl.load(w_ptr + col_base + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset
    y = (h - mean[:, None]) * rstd[:, None] * w
    if HAS_BIAS:
        y += tl.load(b_ptr + col_base + cols, mask=col_mask, other=0.0).to(tl.float32)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            z = tl.load(z_ptr + rows64 * stride_z + col_base + cols, mask=mask, other=0.0).to(tl.float32)
            silu_z, _ = _silu_and_grad(z)
            y = y * silu_z
    tl.store(y_ptr + rows64 * stride_y + col_base + cols, y.to(y_ptr.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["seed"])
def _norm_fwd_kernel(x_ptr, res_ptr, z_ptr, w_ptr, b_ptr, y_ptr, res_out_ptr, mean_ptr, rstd_ptr,
                     M, G, NGROUPS, stride_x, stride_res, stride_z, stride_y, stride_res_out,
                     eps, weight_offset, x1_ptr, rs_ptr, mask_ptr, mask1_ptr, seed, dropout_p, stride_x1, stride_mask,
                     w1_ptr, b1_ptr, y1_ptr, stride_y1,
                     IS_RMS: tl.constexpr, HAS_RES: tl.constexpr, STORE_RES_OUT: tl.constexpr,
                     HAS_BIAS: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
                     HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                     STORE_MASK: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """Grid (cdiv(M, ROWS), NGROUPS): one [ROWS, G] slice of rows and one group per program. The
    extras' arguments (x1 ... stride_y1) are None when their flag is off; HAS_W1: the second
    output y1 = xhat * (w1 + weight_offset) (+ b1) of the same statistics."""
    g = tl.program_id(1)
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_mask = rows < M
    rows64 = rows.to(tl.int64)[:, None]
    col_base = g * G
    offs = tl.arange(0, BLOCK_N)[None, :]
    if SINGLE_BLOCK:  # the whole group stays in registers: one read of x
        col_mask = offs < G
        mask = row_mask[:, None] & col_mask
        h = _fwd_load_h(x_ptr, res_ptr, z_ptr, res_out_ptr, rows64, col_base, offs, mask,
                        stride_x, stride_res, stride_z, stride_res_out,
                        x1_ptr, rs_ptr, mask_ptr, mask1_ptr, seed, dropout_p, stride_x1, stride_mask, G,
                        HAS_RES, STORE_RES_OUT, HAS_Z, NORM_BEFORE_GATE, True,
                        HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_MASK)
        if IS_RMS:
            mean = tl.zeros([ROWS], dtype=tl.float32)
            var = tl.sum(h * h, axis=1) / G
        else:
            mean = tl.sum(h, axis=1) / G
            centred = tl.where(mask, h - mean[:, None], 0.0)
            var = tl.sum(centred * centred, axis=1) / G
        rstd = 1.0 / tl.sqrt(var + eps)
        _fwd_store_y(h, mean, rstd, w_ptr, b_ptr, z_ptr, y_ptr, rows64, col_base, offs, mask, col_mask,
                     stride_z, stride_y, weight_offset, HAS_BIAS, HAS_Z, NORM_BEFORE_GATE)
        if HAS_W1:
            _fwd_store_y(h, mean, rstd, w1_ptr, b1_ptr, z_ptr, y1_ptr, rows64, col_base, offs, mask, col_mask,
                         stride_z, stride_y1, weight_offset, HAS_B1, False, NORM_BEFORE_GATE)
    else:  # chunked: sum (and store residual_out), [centred sum of squares,] normalise
        acc = tl.zeros([ROWS], dtype=tl.float32)
        start = 0
        while start < G:
            cols = start + offs
            mask = row_mask[:, None] & (cols < G)
            h = _fwd_load_h(x_ptr, res_ptr, z_ptr, res_out_ptr, rows64, col_base, cols, mask,
                            stride_x, stride_res, stride_z, stride_res_out,
                            x1_ptr, rs_ptr, mask_ptr, mask1_ptr, seed, dropout_p, stride_x1, stride_mask, G,
                            HAS_RES, STORE_RES_OUT, HAS_Z, NORM_BEFORE_GATE, True,
                            HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_MASK)
            if IS_RMS:
                acc += tl.sum(h * h, axis=1)
            else:
                acc += tl.sum(h, axis=1)
            start += BLOCK_N
        if IS_RMS:
            mean = tl.zeros([ROWS], dtype=tl.float32)
            var = acc / G
        else:
            mean = acc / G
            acc = tl.zeros([ROWS], dtype=tl.float32)
            start = 0
            while start < G:
                cols = start + offs
                mask = row_mask[:, None] & (cols < G)
                h = _fwd_load_h(x_ptr, res_ptr, z_ptr, res_out_ptr, rows64, col_base, cols, mask,
                                stride_x, stride_res, stride_z, stride_res_out,
                                x1_ptr, rs_ptr, mask_ptr, mask1_ptr, seed, dropout_p, stride_x1, stride_mask, G,
                                HAS_RES, STORE_RES_OUT, HAS_Z, NORM_BEFORE_GATE, False,
                                HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_MASK)
                centred = tl.where(mask, h - mean[:, None], 0.0)
                acc += tl.sum(centred * centred, axis=1)
                start += BLOCK_N
            var = acc / G
        rstd = 1.0 / tl.sqrt(var + eps)
        start = 0
        while start < G:
            cols = start + offs
            col_mask = cols < G
            mask = row_mask[:, None] & col_mask
            h = _fwd_load_h(x_ptr, res_ptr, z_ptr, res_out_ptr, rows64, col_base, cols, mask,
                            stride_x, stride_res, stride_z, stride_res_out,
                            x1_ptr, rs_ptr, mask_ptr, mask1_ptr, seed, dropout_p, stride_x1, stride_mask, G,
                            HAS_RES, STORE_RES_OUT, HAS_Z, NORM_BEFORE_GATE, False,
                            HAS_X1, HAS_ROWSCALE, HAS_DROPOUT, STORE_MASK)
            _fwd_store_y(h, mean, rstd, w_ptr, b_ptr, z_ptr, y_ptr, rows64, col_base, cols, mask, col_mask,
                         stride_z, stride_y, weight_offset, HAS_BIAS, HAS_Z, NORM_BEFORE_GATE)
            if HAS_W1:
                _fwd_store_y(h, mean, rstd, w1_ptr, b1_ptr, z_ptr, y1_ptr, rows64, col_base, cols, mask, col_mask,
                             stride_z, stride_y1, weight_offset, HAS_B1, False, NORM_BEFORE_GATE)
            start += BLOCK_N
    stat = rows.to(tl.int64) * NGROUPS + g
    if not IS_RMS:
        tl.store(mean_ptr + stat, mean, mask=row_mask)
    tl.store(rstd_ptr + stat, rstd, mask=row_mask)


@triton.jit
def _bwd_weight(w_ptr, col_base, cols, col_mask, weight_offset):
    return tl.load(w_ptr + col_base + cols, mask=col_mask, other=0.0).to(tl.float32) + weight_offset


@triton.jit
def _bwd_load(h_ptr, z_ptr, w, dy_ptr, mean, rstd, rows64, col_base, cols, mask,
              stride_h, stride_z, stride_dy,
              HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr):
    """For a tile (w: weight + offset of its columns): xhat, the gradient at the norm's scaled
    output (gate applied), w * that, and what the gate's gradients need: x, silu(z), silu'(z),
    and dz when the gate comes last."""
    x = tl.load(h_ptr + rows64 * stride_h + col_base + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + rows64 * stride_dy + col_base + cols, mask=mask, other=0.0).to(tl.float32)
    h = x
    silu_z = x
    dsilu_z = x
    dz = x
    if HAS_Z:
        z = tl.load(z_ptr + rows64 * stride_z + col_base + cols, mask=mask, other=0.0).to(tl.float32)
        silu_z, dsilu_z = _silu_and_grad(z)
        if not NORM_BEFORE_GATE:
            h = x * silu_z
    xhat = tl.where(mask, (h - mean[:, None]) * rstd[:, None], 0.0)
    if HAS_Z:
        if NORM_BEFORE_GATE:
            dz = dy * xhat * w * dsilu_z
            dy = dy * silu_z
    return xhat, dy, dy * w, x, silu_z, dsilu_z, dz


@triton.jit
def _norm_bwd_rowstats_kernel(h_ptr, z_ptr, w_ptr, mean_ptr, rstd_ptr, dy_ptr, rowstats_ptr,
                              M, G, NGROUPS, stride_h, stride_z, stride_dy, weight_offset, w1_ptr, dy1_ptr, stride_dy1,
                              IS_RMS: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                              BLOCK_N: tl.constexpr, HAS_W1: tl.constexpr):
    """Grid (M, NGROUPS): rowstats[row, g] = (mean(xhat * w dy), mean(w dy)) over the group; with
    HAS_W1, w dy is w dy + w1 dy1 (w1_ptr ... stride_dy1 None without)."""
    g = tl.program_id(1)
    rows = tl.program_id(0) + tl.arange(0, 1)
    rows64 = rows.to(tl.int64)[:, None]
    stat = rows.to(tl.int64) * NGROUPS + g
    rstd = tl.load(rstd_ptr + stat)
    if IS_RMS:
        mean = tl.zeros([1], dtype=tl.float32)
    else:
        mean = tl.load(mean_ptr + stat)
    offs = tl.arange(0, BLOCK_N)[None, :]
    c1 = tl.zeros([1], dtype=tl.float32)
    c2 = tl.zeros([1], dtype=tl.float32)
    start = 0
    while start < G:
        cols = start + offs
        col_mask = cols < G
        w = _bwd_weight(w_ptr, g * G, cols, col_mask, weight_offset)
        xhat, _, wdy, _, _, _, _ = _bwd_load(h_ptr, z_ptr, w, dy_ptr, mean, rstd, rows64, g * G, cols,
                                             col_mask, stride_h, stride_z, stride_dy, HAS_Z, NORM_BEFORE_GATE)
        if HAS_W1:
            dy1 = tl.load(dy1_ptr + rows64 * stride_dy1 + cols, mask=col_mask, other=0.0).to(tl.float32)
            wdy += dy1 * _bwd_weight(w1_ptr, g * G, cols, col_mask, weight_offset)
        c1 += tl.sum(xhat * wdy, axis=1)
        c2 += tl.sum(wdy, axis=1)
        start += BLOCK_N
    tl.store(rowstats_ptr + stat * 2, c1 / G)
    tl.store(rowstats_ptr + stat * 2 + 1, c2 / G)


@triton.jit(do_not_specialize=["NUM_PARTIALS", "seed"])  # one compiled kernel whatever the grid size
def _norm_bwd_kernel(h_ptr, z_ptr, w_ptr, mean_ptr, rstd_ptr, dy_ptr, dres_out_ptr, rowstats_ptr,
                     dx_ptr, dres_ptr, dz_ptr, partials_ptr, dw_ptr, db_ptr, counters_ptr,
                     M, G, NGROUPS, NUM_PARTIALS, stride_partials, stride_h, stride_z, stride_dy, stride_dres_out,
                     stride_dx, stride_dres, stride_dz, weight_offset,
                     x_ptr, dx1_ptr, rs_ptr, drs_ptr, seed, dropout_p, stride_x, stride_dx1,
                     w1_ptr, dy1_ptr, dw1_ptr, db1_ptr, stride_dy1,
                     IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, HAS_DRES_OUT: tl.constexpr,
                     HAS_DRES: tl.constexpr, HAS_Z: tl.constexpr, NORM_BEFORE_GATE: tl.constexpr,
                     STATS_GIVEN: tl.constexpr, NUM_SLABS: tl.constexpr,
                     ROWS: tl.constexpr, BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr,
                     RELOAD_WEIGHT: tl.constexpr, FUSE_SUM: tl.constexpr,
                     SUM_BLOCK_P: tl.constexpr, SUM_BLOCK_N: tl.constexpr,
                     HAS_X1: tl.constexpr, HAS_ROWSCALE: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                     HAS_DRS: tl.constexpr, HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """Grid (NUM_PARTIALS, NGROUPS * NUM_SLABS): program (p, q) walks the row tiles p, p + P, ... of
    group q // NUM_SLABS, columns [slab * BLOCK_N, (slab + 1) * BLOCK_N) of it, and writes row p of
    the partial sums of dweight (and dbias, ``stride_partials`` further on) for those columns.
    FUSE_SUM (one group, one slab, a cooperative launch): then all programs meet at a grid barrier
    and sum the partial rows into dw / db themselves, SUM_BLOCK_N columns at a time. flash-attn's
    extras (x_ptr ... stride_dx1, None when their flags are off): dx1 = dropout(dh), dx =
    dropout(dh) * rowscale, drowscale's partial sum of this slab (x . dropout(dh)) at [row, slab].
    HAS_W1 (w1_ptr ... stride_dy1): y1's gradient dy1 adds w1 dy1 to the normalised gradient, and
    dweight1 (and dbias1) are summed as dweight and dbias are; the partial sums' order is dweight,
    [dbias,] dweight1, [dbias1], ``stride_partials`` apart."""
    pid = tl.program_id(0)
    g = tl.program_id(1) // NUM_SLABS
    slab = tl.program_id(1) % NUM_SLABS
    col_base = g * G
    cols = slab * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    col_mask = cols < G
    # [ROWS, BLOCK_N] sums: the cross-row reduction happens once, after the loop
    dw_acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    if not RELOAD_WEIGHT:  # once: the same columns every row (costs registers)
        w_kept = _bwd_weight(w_ptr, col_base, cols, col_mask, weight_offset)
    if HAS_W1:
        dw1_acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        db1_acc = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
        if not RELOAD_WEIGHT:
            w1_kept = _bwd_weight(w1_ptr, col_base, cols, col_mask, weight_offset)
    num_tiles = tl.cdiv(M, ROWS)
    for tile in tl.range(pid, num_tiles, NUM_PARTIALS, num_stages=NUM_STAGES):
        rows = tile * ROWS + tl.arange(0, ROWS)
        row_mask = rows < M
        rows64 = rows.to(tl.int64)[:, None]
        stat = rows.to(tl.int64) * NGROUPS + g
        mask = row_mask[:, None] & col_mask
        rstd = tl.load(rstd_ptr + stat, mask=row_mask, other=0.0)
        if IS_RMS:
            mean = tl.zeros([ROWS], dtype=tl.float32)
        else:
            mean = tl.load(mean_ptr + stat, mask=row_mask, other=0.0)
        if RELOAD_WEIGHT:  # from L1 each row: no registers held across rows
            w = _bwd_weight(w_ptr, col_base, cols, col_mask, weight_offset)
        else:
            w = w_kept
        xhat, dy, wdy, x, silu_z, dsilu_z, dz = _bwd_load(
            h_ptr, z_ptr, w, dy_ptr, mean, rstd, rows64, col_base, cols, mask,
            stride_h, stride_z, stride_dy, HAS_Z, NORM_BEFORE_GATE)
        if HAS_W1:  # y1 = xhat * w1 + b1 shares xhat: its gradient joins the normalised one
            dy1 = tl.load(dy1_ptr + rows64 * stride_dy1 + cols, mask=mask, other=0.0).to(tl.float32)
            if RELOAD_WEIGHT:
                wdy += dy1 * _bwd_weight(w1_ptr, col_base, cols, col_mask, weight_offset)
            else:
                wdy += dy1 * w1_kept
        if STATS_GIVEN:
            c1 = tl.load(rowstats_ptr + stat * 2, mask=row_mask, other=0.0)
            c2 = tl.load(rowstats_ptr + stat * 2 + 1, mask=row_mask, other=0.0)
        else:
            c1 = tl.sum(xhat * wdy, axis=1) / G
            c2 = tl.sum(wdy, axis=1) / G
        if IS_RMS:
            dh = (wdy - xhat * c1[:, None]) * rstd[:, None]
        else:
            dh = (wdy - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        if HAS_DRES_OUT:
            dh += tl.load(dres_out_ptr + rows64 * stride_dres_out + cols, mask=mask, other=0.0).to(tl.float32)
        dx = dh
        if HAS_Z:
            if not NORM_BEFORE_GATE:
                dz = dh * x * dsilu_z
                dx = dh * silu_z
            tl.store(dz_ptr + rows64 * stride_dz + col_base + cols, dz.to(dz_ptr.dtype.element_ty), mask=mask)
        if HAS_X1:
            dx1 = dh
            if HAS_DROPOUT:
                dx1 = _dropout(dh, _keep(seed + 1, rows64, G, cols, dropout_p), dropout_p)
            tl.store(dx1_ptr + rows64 * stride_dx1 + cols, dx1.to(dx1_ptr.dtype.element_ty), mask=mask)
        if HAS_DROPOUT:
            dx = _dropout(dh, _keep(seed, rows64, G, cols, dropout_p), dropout_p)
        if HAS_DRS:
            x_in = tl.load(x_ptr + rows64 * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(drs_ptr + rows.to(tl.int64) * NUM_SLABS + slab, tl.sum(dx * x_in, axis=1), mask=row_mask)
        if HAS_ROWSCALE:
            dx = dx * tl.load(rs_ptr + rows64 + 0 * cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(dx_ptr + rows64 * stride_dx + col_base + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
        if HAS_DRES:
            tl.store(dres_ptr + rows64 * stride_dres + cols, dh.to(dres_ptr.dtype.element_ty), mask=mask)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
        if HAS_W1:
            dw1_acc += dy1 * xhat
            if HAS_B1:
                db1_acc += dy1
    out = partials_ptr + pid.to(tl.int64) * (G * NGROUPS) + col_base + cols
    tl.store(out, tl.sum(dw_acc, axis=0)[None, :], mask=col_mask)
    if HAS_BIAS:
        tl.store(out + stride_partials, tl.sum(db_acc, axis=0)[None, :], mask=col_mask)
    if HAS_W1:
        tl.store(out + (1 + HAS_BIAS) * stride_partials, tl.sum(dw1_acc, axis=0)[None, :], mask=col_mask)
        if HAS_B1:
            tl.store(out + (2 + HAS_BIAS) * stride_partials, tl.sum(db1_acc, axis=0)[None, :], mask=col_mask)
    if FUSE_SUM:
        _grid_barrier(counters_ptr, NUM_PARTIALS)
        block = pid
        while block * SUM_BLOCK_N < G:
            sum_cols = block * SUM_BLOCK_N + tl.arange(0, SUM_BLOCK_N)
            sum_mask = sum_cols < G
            total = _column_sums(partials_ptr, sum_cols, sum_mask, NUM_PARTIALS, G, SUM_BLOCK_P, SUM_BLOCK_N)
            tl.store(dw_ptr + sum_cols, total.to(dw_ptr.dtype.element_ty), mask=sum_mask)
            if HAS_BIAS:
                total = _column_sums(partials_ptr + stride_partials, sum_cols, sum_mask, NUM_PARTIALS, G,
                                     SUM_BLOCK_P, SUM_BLOCK_N)
                tl.store(db_ptr + sum_cols, total.to(db_ptr.dtype.element_ty), mask=sum_mask)
            if HAS_W1:
                total = _column_sums(partials_ptr + (1 + HAS_BIAS) * stride_partials, sum_cols, sum_mask, NUM_PARTIALS,
                                     G, SUM_BLOCK_P, SUM_BLOCK_N)
                tl.store(dw1_ptr + sum_cols, total.to(dw1_ptr.dtype.element_ty), mask=sum_mask)
                if HAS_B1:
                    total = _column_sums(partials_ptr + (2 + HAS_BIAS) * stride_partials, sum_cols, sum_mask,
                                         NUM_PARTIALS, G, SUM_BLOCK_P, SUM_BLOCK_N)
                    tl.store(db1_ptr + sum_cols, total.to(db1_ptr.dtype.element_ty), mask=sum_mask)
            block += NUM_PARTIALS
        _grid_depart(counters_ptr, NUM_PARTIALS)


@triton.jit
def _grid_barrier(counters_ptr, num_programs):
    """Returns once all num_programs programs of the launch have called it: counters[0] counts the
    arrivals. Only for cooperative launches (every program resident at once). The pattern of
    cooperative groups' grid sync: a block barrier, then one release increment; acquire polls."""
    tl.debug_barrier()  # (every thread of the program has issued its partial-row stores)
    tl.atomic_add(counters_ptr, 1, sem="release", scope="gpu")
    while tl.atomic_add(counters_ptr, 0, sem="acquire", scope="gpu") < num_programs:
        pass


@triton.jit
def _grid_depart(counters_ptr, num_programs):
    """After ``_grid_barrier``: counters[1] counts the programs done; the last one resets both
    counters to 0 (all others are past the barrier), so the workspace is ready for the next launch."""
    tl.debug_barrier()
    if tl.atomic_add(counters_ptr + 1, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        tl.atomic_xchg(counters_ptr, 0, sem="relaxed", scope="gpu")
        tl.atomic_xchg(counters_ptr + 1, 0, sem="relaxed", scope="gpu")


@triton.jit
def _column_sums(rows_ptr, cols, col_mask, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Sums over the first P fp32 rows of N at rows_ptr, at columns ``cols`` [BLOCK_N]. Loads at L2
    (``.cg``): the rows were written by other programs of the same launch when fused."""
    acc = tl.zeros([BLOCK_P, BLOCK_N], dtype=tl.float32)
    start = 0
    while start < P:
        prow = start + tl.arange(0, BLOCK_P)
        mask = (prow[:, None] < P) & col_mask[None, :]
        acc += tl.load(rows_ptr + prow.to(tl.int64)[:, None] * N + cols[None, :], mask=mask, other=0.0,
                       cache_modifier=".cg")
        start += BLOCK_P
    return tl.sum(acc, axis=0)


@triton.jit
def _sum_partials_kernel(partials_ptr, dw_ptr, db_ptr, P, N, stride_partials, dw1_ptr, db1_ptr,
                         HAS_BIAS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr,
                         HAS_W1: tl.constexpr, HAS_B1: tl.constexpr):
    """Grid (cdiv(N, BLOCK_N), number of sums): column sums of the first P rows of partials[which]
    (fp32 rows of N) into dw, [db,] [dw1, [db1]] in that order (dw1_ptr, db1_ptr None without)."""
    which = tl.program_id(1)
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < N
    total = _column_sums(partials_ptr + which.to(tl.int64) * stride_partials, cols, col_mask, P, N, BLOCK_P, BLOCK_N)
    if HAS_W1:
        if which == 0:
            tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=col_mask)
        if HAS_BIAS:
            if which == 1:
                tl.store(db_ptr + cols, total.to(db_ptr.dtype.element_ty), mask=col_mask)
        if which == 1 + HAS_BIAS:
            tl.store(dw1_ptr + cols, total.to(dw1_ptr.dtype.element_ty), mask=col_mask)
        if HAS_B1:
            if which == 2 + HAS_BIAS:
                tl.store(db1_ptr + cols, total.to(db1_ptr.dtype.element_ty), mask=col_mask)
    elif HAS_BIAS:
        if which == 0:
            tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=col_mask)
        else:
            tl.store(db_ptr + cols, total.to(db_ptr.dtype.element_ty), mask=col_mask)
    else:
        tl.store(dw_ptr + cols, total.to(dw_ptr.dtype.element_ty), mask=col_mask)


# ----------------------------------------------------------------------------------------------
# direct launches


_INT32, _INT64 = range(-(2**31), 2**31), range(-(2**63), 2**63)


def _hooked(hook) -> bool:
    """A launch hook is set: a callable, or a non-empty chain (Triton 3.6's default is an empty
    ``HookChain``; older versions use None)."""
    return bool(getattr(hook, "calls", hook))


class DirectLauncher:
    """Launches a ``@triton.jit`` kernel, calling its compiled binary directly from the second
    launch of each specialisation on. ``JITFunction.run`` binds and mangles every argument and
    rebuilds its cache key on each call, and the binary's launcher asks the driver about every
    tensor address: tens of microseconds of host time per launch, which made the eager fwd+bwd
    host-bound on a fast GPU. Here the first launch of a specialisation goes through
    ``JITFunction.run`` (compiling it) and its ``CompiledKernel`` is kept under a key holding all
    that Triton specialises on: per tensor its dtype and 16-byte alignment, per int its type
    (i32 / i64 / u64 by range) and, unless do_not_specialize, == 1 and % 16 == 0; None-ness;
    the constexprs and options; the device. Later launches pass tensors as integer addresses.
    Interpreter mode and launch hooks (profilers) take Triton's own path every time.

    ``launcher(grid, args, constexprs, options)``: ``args`` the runtime arguments in the kernel's
    order, ``constexprs`` the tuple of its constexpr values in order (the kernel declares them
    last), ``options`` a tuple of (name, value) pairs such as num_warps."""

    def __init__(self, fn):
        self.fn = fn
        self.direct = isinstance(fn, JITFunction)  # (not in interpreter mode)
        self.compiled = {}
        if self.direct:
            n_runtime = sum(not p.is_constexpr for p in fn.params)
            if any(p.is_constexpr for p in fn.params[:n_runtime]):
                raise TypeError(f"{fn.__name__}: DirectLauncher needs the constexpr parameters last")
            self.specialize = tuple(not p.do_not_specialize for p in fn.params[:n_runtime])

    def _named(self, n_args, constexprs, options) -> dict:
        return dict(zip(self.fn.arg_names[n_args:], constexprs), **dict(options))

    def _jit_launch(self, grid, args, constexprs, options):
        return self.fn[grid](*args, **self._named(len(args), constexprs, options))

    def warmup(self, args, constexprs, options=()):
        """The compiled kernel for these arguments, compiled if needed, launching nothing."""
        return self.fn.warmup(*args, grid=(1,), **self._named(len(args), constexprs, options))

    def specialisation(self, args, constexprs, options=()):
        """(cache key, launch arguments: tensors replaced by their addresses) of a launch; key
        None for arguments of other types (bool, numpy scalars), which take Triton's path."""
        launch_args, key = list(args), []
        for i, value in enumerate(args):
            kind = type(value)
            if kind is int:
                if value not in _INT64:
                    return None, args
                # type (i32 / i64) and, when specialised, == 1 (a constant) and % 16 == 0
                key.append((value in _INT32, self.specialize[i] and value == 1,
                            self.specialize[i] and value % 16 == 0))
            elif value is None or kind is float:
                key.append(kind)
            elif hasattr(value, "data_ptr") and kind is not bool:
                address = value.data_ptr()
                key.append((value.dtype, address % 16 == 0))
                launch_args[i] = address
            else:
                return None, args
        device = triton.runtime.driver.active.get_current_device()
        return (device, tuple(key), constexprs, options), launch_args

    def __call__(self, grid, args, constexprs, options=()):
        if not self.direct or _hooked(triton.knobs.runtime.launch_enter_hook) or \
                _hooked(triton.knobs.runtime.launch_exit_hook):
            self._jit_launch(grid, args, constexprs, options)
            return
        key, launch_args = self.specialisation(args, constexprs, options)
        compiled = None if key is None else self.compiled.get(key)
        if compiled is None:  # the first launch of this specialisation compiles (or loads) and runs it
            compiled = self._jit_launch(grid, args, constexprs, options)
            if key is not None:
                self.compiled[key] = compiled
            return
        stream = triton.runtime.driver.active.get_current_stream(key[0])
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, 1, stream, compiled.function,
                     compiled.packed_metadata, None, None, None, *launch_args, *constexprs)


# ----------------------------------------------------------------------------------------------
# launch configuration


_sm_counts = {}


def _num_sms() -> int:
    """SM count of the current device, cached (reading the device properties costs about a
    millisecond of host time); the interpreter runs programs one by one, so any count is right
    there (a small one keeps several partial rows in the tests)."""
    if triton.knobs.runtime.interpret:
        return 2
    active = triton.runtime.driver.active
    device = active.get_current_device()
    if device not in _sm_counts:
        _sm_counts[device] = int(active.utils.get_device_properties(device)["multiprocessor_count"])
    return _sm_counts[device]


def _groups(N: int, group_size) -> tuple:
    if group_size is None:
        return N, 1
    if group_size <= 0 or N % group_size:
        raise ValueError(f"group_size: expected a positive divisor of the last axis {N}, got {group_size}")
    return group_size, N // group_size


def _max_programs_per_sm(num_warps: int) -> int:
    """Programs of num_warps warps an SM can hold at most (64 warp slots; >= 32 registers each)."""
    return max(1, min(64 // num_warps, 65536 // (32 * num_warps * 32)))


def _driver_occupancy(compiled, num_warps: int):
    """Programs of a loaded kernel one SM holds at once, from the CUDA driver's occupancy query
    (None where the kernel is not loaded on a GPU: the compile-only check)."""
    global _libcuda
    if not compiled.function:
        return None
    if _libcuda is None:
        _libcuda = ctypes.CDLL("libcuda.so.1")
    count = ctypes.c_int(0)
    status = _libcuda.cuOccupancyMaxActiveBlocksPerMultiprocessor(
        ctypes.byref(count), ctypes.c_void_p(compiled.function), ctypes.c_int(32 * num_warps),
        ctypes.c_size_t(compiled.metadata.shared))
    return count.value if status == 0 else None


_libcuda = None
_resident_cache = {}


def _resident_programs_per_sm(launcher, args, constexprs, options, num_warps: int) -> int:
    """Programs of the very backward kernel ``launcher`` runs on ``args`` that fit on one SM at
    once (registers, shared memory, warp slots): the persistent grid is that many per SM, so all
    programs run in one wave. The kernel is compiled for the launch's own specialisation (a row
    width or stride that is not a multiple of 16, or a misaligned tensor, compiles to another kernel
    with other register and shared-memory needs), and cached under it. For a cooperative launch it
    is what the driver's occupancy query says, exactly what the launch accepts: 0 means the kernel
    cannot be launched cooperatively at all."""
    if triton.knobs.runtime.interpret:
        return 2
    key, _ = launcher.specialisation(args, constexprs, options)
    cached = None if key is None else _resident_cache.get(key)
    if cached is not None:
        return cached
    compiled = launcher.warmup(args, constexprs, options)
    compiled._init_handles()
    if key is not None:  # the first launch then calls the binary directly too
        launcher.compiled.setdefault(key, compiled)
    props = triton.runtime.driver.active.utils.get_device_properties(
        triton.runtime.driver.active.get_current_device())
    per_sm = _max_programs_per_sm(num_warps)
    if compiled.n_regs:  # (0 where nothing was loaded: the compile-only check)
        per_sm = min(per_sm, 65536 // (32 * num_warps * (-(-compiled.n_regs // 8) * 8)))
    if compiled.metadata.shared:
        per_sm = min(per_sm, props["max_shared_mem"] // compiled.metadata.shared)
    per_sm = max(1, per_sm)
    if ("launch_cooperative_grid", True) in options:
        exact = _driver_occupancy(compiled, num_warps)
        per_sm = per_sm if exact is None else min(per_sm, exact)
    if key is not None:
        _resident_cache[key] = per_sm
    return per_sm


def bwd_workspace_shapes(M: int, N: int, has_bias: bool, group_size=None, max_block: int = BWD_MAX_BLOCK,
                         tuning: BwdTuning = BwdTuning(), has_weight1: bool = False, has_bias1: bool = False):
    """Shapes of the fp32 workspaces ``norm_bwd`` takes: (partials [n_sums, P, N], rowstats
    [M * ngroups, 2] or None); n_sums counts dweight, dbias, dweight1 and dbias1 where given. P is
    an upper bound (``norm_bwd`` uses as many rows as programs fit on the GPU at once). ``tuning``:
    as passed to ``norm_bwd``."""
    G, ngroups = _groups(N, group_size)
    rows, _, slabs, num_warps = _bwd_config(G, max_block, tuning.rows, tuning.num_warps)
    per_sm = _max_programs_per_sm(num_warps)
    num_partials = max(1, min(triton.cdiv(M, rows), _num_sms() * per_sm // (ngroups * slabs)))
    rowstats = (M * ngroups, 2) if slabs > 1 else None
    return (1 + has_bias + has_weight1 + has_bias1, num_partials, N), rowstats


# ----------------------------------------------------------------------------------------------
# launchers


# The checks below read each tensor's shape and strides once: the launchers run on every step,
# and their host time adds to the GPU's whenever the host is the slower of the two.


_itemsizes = {}


def _itemsize(t) -> int:
    """Bytes per element, cached by dtype object (``str(dtype)`` costs microseconds in Paddle)."""
    size = _itemsizes.get(t.dtype)
    if size is None:
        size = _itemsizes[t.dtype] = T.itemsize(t)
    return size


def _check_vector(name: str, t, length: int) -> None:
    """t is None or a contiguous [length] vector."""
    if t is None:
        return
    shape = t.shape  # (not T.shape: this runs for every vector of every launch)
    if len(shape) != 1 or shape[0] != length:
        raise ValueError(f"{name}: expected shape {(length,)}, got {T.shape(t)}")
    if length > 1 and T.strides(t)[0] != 1:
        raise ValueError(f"{name}: launcher expects a contiguous tensor, got strides {T.strides(t)}")


def _check_stats(mean, rstd, length: int, is_rms_norm: bool) -> None:
    if not is_rms_norm and mean is None:
        raise ValueError("mean: LayerNorm needs the [M * ngroups] fp32 mean buffer")
    _check_vector("rstd", rstd, length)
    _check_vector("mean", None if is_rms_norm else mean, length)


def _matrix_shape(name: str, t) -> tuple:
    shape = T.shape(t)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [M, N], got shape {shape}")
    return shape


def _check_extras(M: int, N: int, ngroups: int, z, x1, rowscale, dropout_p: float, seed, masks) -> None:
    """flash-attn's extras (x1, rowscale, dropout): ungrouped, ungated norms only; a seed with dropout."""
    if (x1 is not None or rowscale is not None or dropout_p) and (ngroups != 1 or z is not None):
        raise ValueError("x1, rowscale, dropout_p: not supported together with z or group_size < N")
    _check_vector("rowscale", rowscale, M)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p: expected a number in [0, 1), got {dropout_p}")
    if dropout_p and seed is None:
        raise ValueError("seed: dropout needs the seed of its keep-mask")
    if any(m is not None for m in masks) and not dropout_p:
        raise ValueError("dropout_mask: given without dropout_p > 0")


def _check_weight1(N: int, ngroups: int, z, weight1, required, optional) -> None:
    """flash-attn's second output (ungrouped, ungated norms only): the (name, tensor) pairs
    ``required`` come exactly with weight1, the ``optional`` [N] vectors only with it."""
    for name, t in required + optional:
        if weight1 is None and t is not None:
            raise ValueError(f"{name}: given without weight1")
    if weight1 is None:
        return
    if ngroups != 1 or z is not None:
        raise ValueError("weight1: not supported together with z or group_size < N")
    for name, t in required:
        if t is None:
            raise ValueError(f"{name}: needed with weight1")
    for name, t in (("weight1", weight1),) + optional:
        _check_vector(name, t, N)


def _fwd_extras_strides(M, N, ngroups, z, residual_out, x1, rowscale, dropout_p, seed, dropout_mask,
                        dropout_mask1) -> tuple:
    """Checks ``norm_fwd``'s extras; the row strides of x1 and of the masks."""
    _check_extras(M, N, ngroups, z, x1, rowscale, dropout_p, seed, (dropout_mask, dropout_mask1))
    if residual_out is None:
        raise ValueError("residual_out: x1, rowscale and dropout need the stream h stored for the backward")
    if (dropout_mask1 is not None) != (dropout_mask is not None and x1 is not None):
        raise ValueError("dropout_mask1: give it with dropout_mask exactly when x1 is given")
    stride_x1 = None if x1 is None else T.row_stride("x1", x1, M, N)
    stride_mask = None
    for name, t in (("dropout_mask", dropout_mask), ("dropout_mask1", dropout_mask1)):
        if t is not None:
            stride = T.row_stride(name, t, M, N)
            if stride_mask is not None and stride != stride_mask:
                raise ValueError("dropout_mask1: expected dropout_mask's row stride")
            stride_mask = stride
    return stride_x1, stride_mask


def norm_fwd(x, weight, bias, y, mean, rstd, *, residual=None, residual_out=None, z=None, eps: float = 1e-5,
             is_rms_norm: bool = False, weight_offset: float = 0.0, group_size=None,
             norm_before_gate: bool = True, x1=None, rowscale=None, dropout_p: float = 0.0, seed=None,
             dropout_mask=None, dropout_mask1=None, weight1=None, bias1=None, y1=None,
             max_block: int = FWD_MAX_BLOCK, tuning: FwdTuning = FwdTuning()) -> None:
    """y = norm(x (+ residual)) (gated by z); writes y, residual_out (if given), mean (LayerNorm) and
    rstd. ``residual`` / ``residual_out`` are for ungrouped norms; ``z`` / ``group_size`` for the
    gated RMSNorm. flash-attn's extras (ungrouped, ungated; residual_out needed): h =
    dropout(x * rowscale [M]) + dropout(x1) + residual, dropout's keep-mask Philox from ``seed``
    (x1's from seed + 1), written (as 0/1) to ``dropout_mask`` / ``dropout_mask1`` when given;
    ``weight1`` (and ``bias1``) [N]: a second output ``y1`` [M, N] = xhat * (weight1 +
    weight_offset) + bias1 from the same statistics (ungrouped, ungated; residual_out not needed).
    ``max_block`` caps the register tile (tests use it to reach the chunked path); ``tuning``
    overrides the table's tile (benchmarks and variant tests)."""
    M, N = _matrix_shape("x", x)
    G, ngroups = _groups(N, group_size)
    if (residual is not None or residual_out is not None) and ngroups != 1:
        raise ValueError("residual: not supported together with group_size < N")
    strides = [T.row_stride(name, t, M, N) for name, t in (("x", x), ("residual", residual), ("z", z), ("y", y),
                                                          ("residual_out", residual_out))]
    stride_x1 = stride_mask = None
    if x1 is not None or rowscale is not None or dropout_p or dropout_mask is not None or dropout_mask1 is not None:
        dropout_p = float(dropout_p)
        stride_x1, stride_mask = _fwd_extras_strides(M, N, ngroups, z, residual_out, x1, rowscale, dropout_p, seed,
                                                     dropout_mask, dropout_mask1)
    for name, t in (("weight", weight), ("bias", bias)):
        _check_vector(name, t, N)
    stride_y1 = None
    if weight1 is not None or bias1 is not None or y1 is not None:
        _check_weight1(N, ngroups, z, weight1, (("y1", y1),), (("bias1", bias1),))
        stride_y1 = T.row_stride("y1", y1, M, N)
    _check_stats(mean, rstd, M * ngroups, is_rms_norm)
    if M == 0 or N == 0:
        return
    rows, block_n, num_warps = _fwd_config(G, max_block, tuning.rows, tuning.num_warps)
    store_mask = dropout_mask is not None
    _launch_fwd((triton.cdiv(M, rows), ngroups),
                (x, residual, z, weight, bias, y, residual_out, None if is_rms_norm else mean, rstd,
                 M, G, ngroups, *strides, float(eps), float(weight_offset),
                 # the extras' arguments: None when unused, so the default kernels stay as they were
                 x1, rowscale, dropout_mask, dropout_mask1, int(seed) if dropout_p else None,
                 dropout_p if dropout_p else None, stride_x1, stride_mask, weight1, bias1, y1, stride_y1),
                (is_rms_norm, residual is not None, residual_out is not None, bias is not None, z is not None,
                 norm_before_gate, rows, block_n, block_n >= G,
                 x1 is not None, rowscale is not None, dropout_p > 0, store_mask, weight1 is not None,
                 bias1 is not None), (("num_warps", num_warps),))


def drowscale_shape(M: int, N: int, max_block: int = BWD_MAX_BLOCK, tuning: BwdTuning = BwdTuning()) -> tuple:
    """Shape of ``norm_bwd``'s fp32 ``drowscale`` output: per row, one partial sum per column slab
    (the caller sums the last axis)."""
    return M, _bwd_config(N, max_block, tuning.rows, tuning.num_warps)[2]


def norm_bwd(h, weight, mean, rstd, dy, dx, dweight, partials, *, dbias=None, dresidual_out=None,
             dresidual=None, z=None, dz=None, rowstats=None, counters=None, is_rms_norm: bool = False,
             weight_offset: float = 0.0, group_size=None, norm_before_gate: bool = True, x=None, dx1=None,
             rowscale=None, drowscale=None, dropout_p: float = 0.0, seed=None, weight1=None, dy1=None,
             dweight1=None, dbias1=None, max_block: int = BWD_MAX_BLOCK, tuning: BwdTuning = BwdTuning()) -> None:
    """Gradients of ``norm_fwd``. ``h`` is what the forward normalised before gating: residual_out
    when it stored one, else x. Writes dx (= dh, plus dresidual_out), dresidual (dh in the
    residual's dtype, when that differs from dx's), dz (gated), dweight and dbias; ``partials`` and
    ``rowstats`` are workspaces shaped by ``bwd_workspace_shapes``. ``counters``: an int32
    [COUNTERS] workspace of zeros (left zeroed); given, a backward of one column slab and one group
    sums dweight/dbias in its own (cooperative) launch instead of a second kernel's, when the
    cooperative grid fits on the GPU (else the two kernels run). flash-attn's extras, as passed to
    ``norm_fwd``: ``dx1`` (x1's gradient, given exactly when the forward had x1), ``rowscale``,
    ``dropout_p`` / ``seed``; ``drowscale`` (``drowscale_shape``, fp32) with ``x`` (the forward's x):
    rowscale's gradient in partial sums. flash-attn's second output: ``weight1`` with ``dy1`` (y1's
    gradient [M, N]) writes ``dweight1`` (and ``dbias1``, given exactly when the forward had bias1),
    summed as dweight is (the workspace shaped with has_weight1 / has_bias1). ``max_block`` as
    there; ``tuning`` overrides the table's tile and loop (pass the same to ``bwd_workspace_shapes``)."""
    M, N = _matrix_shape("h", h)
    G, ngroups = _groups(N, group_size)
    stride_dy1 = None
    if weight1 is not None or dy1 is not None or dweight1 is not None or dbias1 is not None:
        _check_weight1(N, ngroups, z, weight1, (("dy1", dy1), ("dweight1", dweight1)), (("dbias1", dbias1),))
        _check_vector("dweight1", dweight1, N)
        stride_dy1 = T.row_stride("dy1", dy1, M, N)
    stride_x = stride_dx1 = None
    if dx1 is not None or rowscale is not None or dropout_p or drowscale is not None or x is not None:
        dropout_p = float(dropout_p)
        _check_extras(M, N, ngroups, z, dx1, rowscale, dropout_p, seed, ())
        if (drowscale is None) != (x is None) or (drowscale is not None and rowscale is None):
            raise ValueError("drowscale: give it with x (the forward's input), and with rowscale")
        if drowscale is not None:
            T.check_same_shape("drowscale", drowscale, drowscale_shape(M, N, max_block, tuning))
            T.check_contiguous("drowscale", drowscale)
        stride_x, stride_dx1 = (None if t is None else T.row_stride(name, t, M, N)
                                for name, t in (("x", x), ("dx1", dx1)))
    stride_h, stride_z, stride_dy, stride_dres_out, stride_dx, stride_dres, stride_dz = (
        T.row_stride(name, t, M, N) for name, t in (("h", h), ("z", z), ("dy", dy), ("dresidual_out", dresidual_out),
                                                   ("dx", dx), ("dresidual", dresidual), ("dz", dz)))
    if (z is None) != (dz is None):
        raise ValueError("z and dz: give both or neither")
    for name, t in (("weight", weight), ("dweight", dweight), ("dbias", dbias)):
        _check_vector(name, t, N)
    _check_stats(mean, rstd, M * ngroups, is_rms_norm)
    rows, block_n, slabs, num_warps = _bwd_config(G, max_block, tuning.rows, tuning.num_warps)
    num_stages, reload_weight = tuning.num_stages or _bwd_stages(rows * block_n), tuning.reload_weight
    # each pipeline stage buffers one tile of every row tensor loaded in the loop: keep the
    # buffers within shared memory (sm_80: 163 KiB; 128 KiB leaves room for the reductions)
    stage_bytes = rows * block_n * sum(_itemsize(t) for t in (h, dy, z, dresidual_out, x, dy1) if t is not None)
    num_stages = max(1, min(num_stages, 1 + _STAGE_BUFFER_BYTES // stage_bytes))
    n_sums = sum(t is not None for t in (dweight, dbias, dweight1, dbias1))
    partials_shape = T.shape(partials)
    num_partials = partials_shape[1] if len(partials_shape) == 3 else 0
    if partials_shape != (n_sums, num_partials, N) or not num_partials:
        raise ValueError(f"partials: expected an fp32 workspace [{n_sums}, P >= 1, {N}], got shape {partials_shape}")
    T.check_contiguous("partials", partials)
    if counters is not None:
        _check_vector("counters", counters, COUNTERS)
        if T.dtype_name(counters) != "int32":
            raise TypeError(f"counters: expected int32, got {T.dtype_name(counters)}")
    if slabs > 1:
        if rowstats is None:
            raise ValueError(f"rowstats: a [{M * ngroups}, 2] fp32 workspace is needed for groups of {G}")
        T.check_same_shape("rowstats", rowstats, (M * ngroups, 2))
        T.check_contiguous("rowstats", rowstats)
    if N == 0:
        return
    if M:
        if slabs > 1:
            _launch_rowstats((M, ngroups),
                             (h, z, weight, None if is_rms_norm else mean, rstd, dy, rowstats, M, G, ngroups,
                              stride_h, stride_z, stride_dy, float(weight_offset), weight1, dy1, stride_dy1),
                             (is_rms_norm, z is not None, norm_before_gate, block_n, weight1 is not None),
                             (("num_warps", _warps(block_n)),))
        scalars = (num_partials * N, stride_h, stride_z, stride_dy, stride_dres_out, stride_dx, stride_dres, stride_dz,
                   float(weight_offset),
                   # the extras' arguments: None when unused, so the default kernels stay as they were
                   x, dx1, rowscale, drowscale, int(seed) if dropout_p else None, dropout_p if dropout_p else None,
                   stride_x, stride_dx1, weight1, dy1)

        def launch_args(fuse, programs):
            tensors = (h, z, weight, None if is_rms_norm else mean, rstd, dy, dresidual_out,
                       rowstats if slabs > 1 else None, dx, dresidual, dz, partials) + \
                      ((dweight, dbias, counters) if fuse else (None, None, None))
            sums1 = (dweight1, dbias1) if fuse else (None, None)
            constexprs = (is_rms_norm, dbias is not None, dresidual_out is not None, dresidual is not None,
                          z is not None, norm_before_gate, slabs > 1, slabs, rows, block_n, num_stages, reload_weight,
                          fuse, _FUSED_SUM_BLOCK_P, _FUSED_SUM_BLOCK_N,
                          dx1 is not None, rowscale is not None, dropout_p > 0, drowscale is not None,
                          weight1 is not None, dbias1 is not None)
            options = (("num_warps", num_warps),) + ((("launch_cooperative_grid", True),) if fuse else ())
            return tensors + (M, G, ngroups, programs) + scalars + sums1 + (stride_dy1,), constexprs, options

        # the partial sums in the same launch: needs every program resident (a cooperative launch;
        # never in the interpreter, which runs programs one after another)
        fuse = counters is not None and ngroups * slabs == 1 and not triton.knobs.runtime.interpret
        per_sm = _resident_programs_per_sm(_launch_bwd, *launch_args(fuse, 1), num_warps)
        if fuse and per_sm == 0:  # the kernel cannot be co-resident at all: the two-kernel sums
            fuse = False
            per_sm = _resident_programs_per_sm(_launch_bwd, *launch_args(fuse, 1), num_warps)
        programs = max(1, min(num_partials, triton.cdiv(M, rows), _num_sms() * per_sm // (ngroups * slabs)))
        _launch_bwd((programs, ngroups * slabs), *launch_args(fuse, programs))
        if fuse:
            return
    # with no rows the weights' gradients are sums over no partial rows: zeros
    _launch_sum((triton.cdiv(N, _SUM_BLOCK_N), n_sums),
                (partials, dweight, dbias, programs if M else 0, N, num_partials * N, dweight1, dbias1),
                (dbias is not None, _SUM_BLOCK_P, _SUM_BLOCK_N, dweight1 is not None, dbias1 is not None),
                (("num_warps", 4),))


_launch_fwd = DirectLauncher(_norm_fwd_kernel)
_launch_rowstats = DirectLauncher(_norm_bwd_rowstats_kernel)
_launch_bwd = DirectLauncher(_norm_bwd_kernel)
_launch_sum = DirectLauncher(_sum_partials_kernel)


def compile_cases():
    """Launches for the compile-only check (SpecTensor arguments): per dtype, LayerNorm with bias,
    an fp32 residual stream and prenorm at the canonical width, and with the fused partial sums;
    RMSNorm at 65536 (chunked forward, backward in slabs); the gated RMSNorm with groups and the
    gate first; the gated LayerNorm with bias, gate last (dz in fp32, as ops.norm passes it); y in
    another dtype than x (out_dtype) with a weight in a third; flash-attn's extras (rowscale with
    dropout and its stored mask, x1 with dropout) at the canonical width and at 65536 (slabs);
    flash-attn's second output (weight1 and bias1 with an fp32 residual stream: fused sums at the
    canonical width, the pre-pass and the sums kernel at 65536; RMSNorm's weight1 alone at 3000
    through the sums kernel)."""
    f32 = "float32"
    for dtype in T.FLOAT_DTYPES:
        M, N = 16384, 4096
        x, res, res_out = T.SpecTensor((M, N), dtype), T.SpecTensor((M, N), f32), T.SpecTensor((M, N), f32)
        w, b, stat = T.SpecTensor((N,), f32), T.SpecTensor((N,), f32), T.SpecTensor((M,), f32)
        partials, _ = bwd_workspace_shapes(M, N, True)
        yield f"layer_norm_fwd[{dtype},N={N},residual]", lambda x=x, r=res, ro=res_out, w=w, b=b, s=stat: \
            norm_fwd(x, w, b, x, s, s, residual=r, residual_out=ro)
        yield f"layer_norm_bwd[{dtype},N={N},residual]", lambda x=x, ro=res_out, w=w, b=b, s=stat, p=partials: \
            norm_bwd(ro, w, s, s, x, x, w, T.SpecTensor(p, f32), dbias=b, dresidual_out=ro, dresidual=ro)
        yield f"layer_norm_bwd[{dtype},N={N},fused sums]", lambda x=x, w=w, b=b, s=stat, p=partials: \
            norm_bwd(x, w, s, s, x, x, w, T.SpecTensor(p, f32), dbias=b, counters=T.SpecTensor((COUNTERS,), "int32"))

        M, N = 4096, 3000  # a row width that is not a multiple of 16 compiles to another kernel
        x, w, stat = T.SpecTensor((M, N), dtype), T.SpecTensor((N,), f32), T.SpecTensor((M,), f32)
        partials, _ = bwd_workspace_shapes(M, N, True)
        yield f"layer_norm_bwd[{dtype},N={N},fused sums]", lambda x=x, w=w, s=stat, p=partials: \
            norm_bwd(x, w, s, s, x, x, w, T.SpecTensor(p, f32), dbias=w, counters=T.SpecTensor((COUNTERS,), "int32"))

        M, N = 64, 65536
        x, w, stat = T.SpecTensor((M, N), dtype), T.SpecTensor((N,), dtype), T.SpecTensor((M,), f32)
        partials, rowstats = bwd_workspace_shapes(M, N, False)
        yield f"rms_norm_fwd[{dtype},N={N}]", lambda x=x, w=w, s=stat: \
            norm_fwd(x, w, None, x, None, s, is_rms_norm=True)
        yield f"rms_norm_bwd[{dtype},N={N}]", lambda x=x, w=w, s=stat, p=partials, r=rowstats: \
            norm_bwd(x, w, None, s, x, x, w, T.SpecTensor(p, f32), rowstats=T.SpecTensor(r, f32), is_rms_norm=True)

        M, N, group = 7, 48, 16
        x, w, stat = T.SpecTensor((M, N), dtype), T.SpecTensor((N,), dtype), T.SpecTensor((M * 3,), f32)
        partials, _ = bwd_workspace_shapes(M, N, False, group_size=group)
        yield f"gated_rms_norm_fwd[{dtype},N={N},group={group}]", lambda x=x, w=w, s=stat: \
            norm_fwd(x, w, None, x, None, s, z=x, is_rms_norm=True, group_size=group, norm_before_gate=False)
        yield f"gated_rms_norm_bwd[{dtype},N={N},group={group}]", lambda x=x, w=w, s=stat, p=partials: \
            norm_bwd(x, w, None, s, x, x, w, T.SpecTensor(p, f32), z=x, dz=x, is_rms_norm=True,
                     group_size=group, norm_before_gate=False)

        b, mean, dz32 = T.SpecTensor((N,), dtype), T.SpecTensor((M * 3,), f32), T.SpecTensor((M, N), f32)
        partials, _ = bwd_workspace_shapes(M, N, True, group_size=group)
        yield f"gated_layer_norm_fwd[{dtype},N={N},group={group},bias]", lambda x=x, w=w, b=b, m=mean, s=stat: \
            norm_fwd(x, w, b, x, m, s, z=x, group_size=group)
        yield f"gated_layer_norm_bwd[{dtype},N={N},group={group},bias]", \
            lambda x=x, w=w, b=b, m=mean, s=stat, p=partials, dz=dz32: \
            norm_bwd(x, w, m, s, x, x, w, T.SpecTensor(p, f32), dbias=b, z=x, dz=dz, group_size=group)

        M, N = 4096, 3000
        other = {"float32": "bfloat16", "float16": "float32", "bfloat16": "float32"}[dtype]
        w_dtype = {"float32": "float16", "float16": "bfloat16", "bfloat16": "float16"}[dtype]
        x, y = T.SpecTensor((M, N), dtype), T.SpecTensor((M, N), other)
        w, stat = T.SpecTensor((N,), w_dtype), T.SpecTensor((M,), f32)
        partials, _ = bwd_workspace_shapes(M, N, True)
        yield f"layer_norm_fwd[{dtype},N={N},out {other},weight {w_dtype}]", lambda x=x, y=y, w=w, s=stat: \
            norm_fwd(x, w, w, y, s, s)
        yield f"layer_norm_bwd[{dtype},N={N},dy {other},weight {w_dtype}]", \
            lambda x=x, y=y, w=w, s=stat, p=partials: \
            norm_bwd(x, w, s, s, y, x, w, T.SpecTensor(p, f32), dbias=w, counters=T.SpecTensor((COUNTERS,), "int32"))

        for M, N in ((16384, 4096), (64, 65536)):
            x, h, stat = T.SpecTensor((M, N), dtype), T.SpecTensor((M, N), f32), T.SpecTensor((M,), f32)
            w, rs, mask = T.SpecTensor((N,), f32), T.SpecTensor((M,), dtype), T.SpecTensor((M, N), "uint8")
            partials, rowstats = bwd_workspace_shapes(M, N, True)
            rowstats = None if rowstats is None else T.SpecTensor(rowstats, f32)
            drs = T.SpecTensor(drowscale_shape(M, N), f32)
            yield f"layer_norm_fwd[{dtype},N={N},rowscale,dropout,mask]", \
                lambda x=x, h=h, w=w, s=stat, rs=rs, m=mask: norm_fwd(
                    x, w, w, x, s, s, residual=x, residual_out=h, rowscale=rs, dropout_p=0.1, seed=1, dropout_mask=m)
            yield f"layer_norm_bwd[{dtype},N={N},rowscale,dropout]", \
                lambda x=x, h=h, w=w, s=stat, rs=rs, p=partials, r=rowstats, d=drs: norm_bwd(
                    h, w, s, s, x, x, w, T.SpecTensor(p, f32), dbias=w, dresidual=x, rowstats=r, x=x, rowscale=rs,
                    drowscale=d, dropout_p=0.1, seed=1, counters=T.SpecTensor((COUNTERS,), "int32"))
            yield f"rms_norm_fwd[{dtype},N={N},x1,dropout]", lambda x=x, h=h, w=w, s=stat: norm_fwd(
                x, w, None, x, None, s, residual_out=h, x1=x, dropout_p=0.1, seed=1, is_rms_norm=True)
            yield f"rms_norm_bwd[{dtype},N={N},x1,dropout]", \
                lambda x=x, h=h, w=w, s=stat, p=partials, r=rowstats: norm_bwd(
                    h, w, None, s, x, x, w, T.SpecTensor((1,) + tuple(p[1:]), f32), rowstats=r, dx1=x,
                    dropout_p=0.1, seed=1, is_rms_norm=True, counters=T.SpecTensor((COUNTERS,), "int32"))
            partials, _ = bwd_workspace_shapes(M, N, True, has_weight1=True, has_bias1=True)
            yield f"layer_norm_fwd[{dtype},N={N},residual,weight1,bias1]", lambda x=x, h=h, w=w, s=stat: norm_fwd(
                x, w, w, x, s, s, residual=x, residual_out=h, weight1=w, bias1=w, y1=x)
            yield f"layer_norm_bwd[{dtype},N={N},residual,weight1,bias1]", \
                lambda x=x, h=h, w=w, s=stat, p=partials, r=rowstats: norm_bwd(
                    h, w, s, s, x, x, w, T.SpecTensor(p, f32), dbias=w, dresidual=x, rowstats=r, weight1=w, dy1=x,
                    dweight1=w, dbias1=w, counters=T.SpecTensor((COUNTERS,), "int32"))

        M, N = 4096, 3000
        x, w, stat = T.SpecTensor((M, N), dtype), T.SpecTensor((N,), dtype), T.SpecTensor((M,), f32)
        partials, _ = bwd_workspace_shapes(M, N, False, has_weight1=True)
        yield f"rms_norm_fwd[{dtype},N={N},weight1]", lambda x=x, w=w, s=stat: norm_fwd(
            x, w, None, x, None, s, is_rms_norm=True, weight1=w, y1=x)
        yield f"rms_norm_bwd[{dtype},N={N},weight1]", lambda x=x, w=w, s=stat, p=partials: norm_bwd(
            x, w, None, s, x, x, w, T.SpecTensor(p, f32), is_rms_norm=True, weight1=w, dy1=x, dweight1=w)
