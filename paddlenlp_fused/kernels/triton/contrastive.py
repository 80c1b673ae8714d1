"""Tiled InfoNCE (contrastive) loss on tensor cores: forward log-sum-exp and blockwise backward.

Notation: ``a [M, D]`` and ``b [N, D]`` (q and k for the row direction, k and q for the column
direction of a symmetric loss), ``S = scale * a @ b.T`` ``[M, N]``, never stored whole.

Forward (``contrastive_lse_fwd``): one program owns ``BLOCK_M`` rows of ``a`` and sweeps every
``BLOCK_N`` rows of ``b``; each score tile is a ``tl.dot`` over D in ``BLOCK_K`` steps (fp32
accumulation, any D by masking), folded into an online log-sum-exp per row (exp2 units). A small
gather kernel writes the positive logit ``S[i, labels[i] - b_offset]`` (one D-long dot a row), which
keeps the compare-and-select out of the hot loop. Writes ``lse [M]`` and ``pos [M]`` (fp32): the row
loss is ``lse - pos``. The column statistics of a symmetric loss are the row statistics of
``S.T = scale * b @ a.T``: the same launcher with a and b swapped.

Backward (``contrastive_grad_accumulate``): with upstream weights per row ``w_a`` and per column
``w_b`` the gradient of the loss with respect to the scores is

    G[i, j] = w_a[i] * (exp(S[i, j] - lse_a[i]) - [j == labels_a[i]])      (row term)
            + w_b[j] * (exp(S[i, j] - lse_b[j]) - [i == labels_b[j]])      (column term, symmetric)

and ``dA = scale * G @ b``, ``dB = scale * G.T @ a``, ``dscale = sum(G * S) / scale``. For D = 512 the
flash-attention layout (a program holding a ``[BLOCK_M, D]`` fp32 gradient accumulator, 256 KB at
BLOCK_M = 128) does not fit in registers, so G is materialised one ``[C, C]`` chunk at a time in a
caller-owned workspace (C = 8192: 128 MiB in bf16) and consumed at once by
two tensor-core GEMM launches whose programs each own an output tile (no atomics):
``ua[chunk rows].T (+)= b[chunk cols].T @ G.T`` and ``ub[chunk cols].T (+)= a[chunk rows].T @ G``,
fp32. Both read the input (b or a) through its transposed view by strides as the A operand (held in
registers, where it is rounded when asked) and G (or G.T, by strides) as the B operand from shared
memory; no transposed copy of anything is made. The scores are recomputed once, so the whole step
is 4 products of ``2 B^2 D`` FLOP (forward, recompute, two gradients), plus ``6 B^2`` bytes of G
traffic. ``ua``/``ub`` are the unscaled gradients: ``dA = scale * ua``, ``dB = scale * ub`` and
``dscale = sum(a * ua)`` (``sum_ij G_ij a_i.b_j = sum_i a_i.(G b)_i``), which the caller forms.

Memory: the kernels read a and b in place; the scratch is the G chunk and the optional staging
buffers below, all constant in the batch, so the loss costs per-row vectors (lse, labels, weights)
beyond its inputs and their gradients, whatever the batch.

Dtypes: a, b float32/float16/bfloat16 (the same). ``precision`` for float32 inputs: "ieee" (exact),
"tf32", or "bf16": bf16 tensor cores on the fp32 inputs (round to nearest even; fp32 accumulation
and log-sum-exp) without a bf16 copy of them in memory, either by rounding each fp32 tile in
registers right before ``tl.dot``, or by staging: the launchers round one chunk of b (``stage``)
and of a (``stage_a``) at a time into small bf16 buffers that the tiles are then read from, so the
tensor cores take them from shared memory as loaded (faster on the H200: a tile rounded in registers
costs twice the bytes and, as the B operand, a round trip through shared memory). 16-bit inputs
ignore ``precision`` ("bf16" is refused for fp16). The
G workspace has the operand dtype (``operand_dtype``: bf16 under "bf16") and holds
``G * G_RANGE / w_max`` (``_g_range``). Row offsets are 64-bit. Labels are int32/int64 global
indices: ``b_offset``/``a_offset`` give the global index of ``b[0]``/``a[0]`` (blocks of a ring over a
data-parallel group). Tiles come from ``DEFAULT_CONFIGS`` or a ``TileConfig`` argument.

Dot operands pass through ``interpreter_compat.dot_operand`` (fp32 in Triton's interpreter, whose
``tl.dot`` mishandles bf16).
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from ...runtime import tensor as T
from .interpreter_compat import INTERPRETING, dot_operand

_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E): the kernels work in exp2
_LN2 = tl.constexpr(0.6931471805599453)
PRECISIONS = ("ieee", "tf32", "bf16")
GRAD_CHUNK = 8192  # rows and columns of one materialised G chunk (beat 4096 in the sweep: benchmarks/NOTES.md)


@triton.jit
def _bf16(x):
    """fp32 x rounded to bf16 (round to nearest even; 16-bit x unchanged). Triton's interpreter
    truncates on ``.to(bfloat16)`` (the GPU rounds), so there the rounding is done on the bits and
    the value stays fp32 (what ``dot_operand`` would make of it anyway)."""
    if x.dtype == tl.float32:
        if INTERPRETING:
            bits = x.to(tl.uint32, bitcast=True)
            bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000
            x = bits.to(tl.float32, bitcast=True)
        else:
            x = x.to(tl.bfloat16)
    return x


@triton.jit
def _dot(a, b, acc, PRECISION: tl.constexpr):
    """acc + a @ b in fp32. "bf16": fp32 tiles are rounded to bf16 here, in registers (tiles read
    from a staging buffer are bf16 already); otherwise the tiles go in as loaded ("ieee"/"tf32"
    steer fp32 operands; 16-bit ones ignore it)."""
    if PRECISION == "bf16":
        acc = tl.dot(dot_operand(_bf16(a)), dot_operand(_bf16(b)), acc)
    else:
        acc = tl.dot(dot_operand(a), dot_operand(b), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _score_tile(a_ptr, b_ptr, rows, cols, M, N, D, stride_a, stride_b,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """a[rows] @ b[cols].T over all of D: [BLOCK_M, BLOCK_N] fp32 (masked rows/cols/D read as 0)."""
    ks = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + ks[None, :]
    b_ptrs = b_ptr + cols.to(tl.int64)[:, None] * stride_b + ks[None, :]
    row_ok = rows[:, None] < M
    col_ok = cols[:, None] < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, D, BLOCK_K):
        if EVEN_D:
            a = tl.load(a_ptrs, mask=row_ok, other=0.0)
            b = tl.load(b_ptrs, mask=col_ok, other=0.0)
        else:
            k_ok = (k0 + ks)[None, :] < D
            a = tl.load(a_ptrs, mask=row_ok & k_ok, other=0.0)
            b = tl.load(b_ptrs, mask=col_ok & k_ok, other=0.0)
        acc = _dot(a, tl.trans(b), acc, PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M", "N", "out_start"])
def _lse_fwd_kernel(a_ptr, b_ptr, lse_ptr, M, N, D, stride_a, stride_b, out_start, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, FLATTEN: tl.constexpr,
                    ACCUMULATE: tl.constexpr):
    """lse[out_start + i] = logsumexp_j scale * a[i].b[j] over this launch's a and b (ACCUMULATE:
    folded into the lse of earlier column chunks already there)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    scale_log2 = scale * _LOG2E
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    for n0 in tl.range(0, N, BLOCK_N, flatten=FLATTEN):
        cols = n0 + tl.arange(0, BLOCK_N)
        s = _score_tile(a_ptr, b_ptr, rows, cols, M, N, D, stride_a, stride_b,
                        BLOCK_M, BLOCK_N, BLOCK_K, EVEN_D, PRECISION) * scale_log2
        if not EVEN_N:
            s = tl.where(cols[None, :] < N, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        l_i = l_i * tl.exp2(m_i - m_new) + tl.sum(tl.exp2(s - m_new[:, None]), axis=1)
        m_i = m_new
    lse = (m_i + tl.log2(l_i)) * _LN2
    lse_ptrs = lse_ptr + out_start + rows
    if ACCUMULATE:
        old = tl.load(lse_ptrs, mask=rows < M, other=0.0)
        top = tl.maximum(old, lse)
        lse = top + tl.log(tl.exp(old - top) + tl.exp(lse - top))
    tl.store(lse_ptrs, lse, mask=rows < M)


@triton.jit(do_not_specialize=["start", "rows"])
def _stage_kernel(src_ptr, dst_ptr, start, rows, D, stride_src, stride_dst,
                  BLOCK_R: tl.constexpr, BLOCK_D: tl.constexpr):
    """dst[r, :D] = bf16(src[start + r, :D]) for r < rows: one chunk of an fp32 input, rounded."""
    rs = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    ds = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = (rs < rows)[:, None] & (ds < D)[None, :]
    x = tl.load(src_ptr + (start + rs).to(tl.int64)[:, None] * stride_src + ds[None, :], mask=mask, other=0.0)
    tl.store(dst_ptr + rs.to(tl.int64)[:, None] * stride_dst + ds[None, :], _bf16(x).to(tl.bfloat16), mask=mask)


@triton.jit
def _as_operand(x, PRECISION: tl.constexpr):
    """x in fp32 as the tensor cores see it (rounded to bf16 first under "bf16")."""
    if PRECISION == "bf16":
        x = _bf16(x)
    return x.to(tl.float32)


@triton.jit(do_not_specialize=["M", "N", "b_offset"])
def _positive_kernel(a_ptr, b_ptr, labels_ptr, pos_ptr, M, N, D, stride_a, stride_b, b_offset, scale,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr, PRECISION: tl.constexpr):
    """pos[i] = scale * a[i] . b[labels[i] - b_offset] (fp32), 0 where that row is not in b."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < M
    target = tl.load(labels_ptr + rows, mask=row_ok, other=-1).to(tl.int64) - b_offset
    found = row_ok & (target >= 0) & (target < N)
    ds = tl.arange(0, BLOCK_D)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + ds[None, :]
    b_ptrs = b_ptr + tl.where(found, target, 0)[:, None] * stride_b + ds[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_D), dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        mask = found[:, None] & ((d0 + ds)[None, :] < D)
        a = _as_operand(tl.load(a_ptrs, mask=mask, other=0.0), PRECISION)
        acc += a * _as_operand(tl.load(b_ptrs, mask=mask, other=0.0), PRECISION)
        a_ptrs += BLOCK_D
        b_ptrs += BLOCK_D
    tl.store(pos_ptr + rows, tl.sum(acc, axis=1) * scale, mask=row_ok)


@triton.jit
def _local_index(labels, start, n):
    """labels - start as int32 where it falls in [0, n), else -1 (compares stay 32-bit in the tile)."""
    local = labels.to(tl.int64) - start
    return tl.where((local >= 0) & (local < n), local, -1).to(tl.int32)


@triton.jit(do_not_specialize=["a_start", "b_start", "a_row0", "b_row0", "a_label_start", "b_label_start"])
def _grad_scores_kernel(a_ptr, b_ptr, lse_a_ptr, lse_b_ptr, w_a_ptr, w_b_ptr, labels_a_ptr, labels_b_ptr,
                        w_max_ptr, g_ptr, a_start, b_start, a_row0, b_row0, M, N, D, stride_a, stride_b, stride_g,
                        a_label_start, b_label_start, scale,
                        ROW_TERM: tl.constexpr, COL_TERM: tl.constexpr, G_RANGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """G[i, j] * G_RANGE / w_max for a[a_start + i], b[b_start + j], i < M, j < N, into g[i, j]; a's
    row i and b's row j are read at a_ptr row ``a_row0 + i`` and b_ptr row ``b_row0 + j`` (a_start
    and b_start themselves, or 0 in a staged chunk)."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    dots = _score_tile(a_ptr + a_row0.to(tl.int64) * stride_a, b_ptr + b_row0.to(tl.int64) * stride_b,
                       rows, cols, M, N, D, stride_a, stride_b, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_D, PRECISION)
    s_log2 = dots * (scale * _LOG2E)
    grad = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if ROW_TERM:  # softmax over b for each row of a
        lse = tl.load(lse_a_ptr + a_start + rows, mask=row_ok, other=0.0) * _LOG2E
        w = tl.load(w_a_ptr + a_start + rows, mask=row_ok, other=0.0)
        target = _local_index(tl.load(labels_a_ptr + a_start + rows, mask=row_ok, other=-1), b_label_start, N)
        p = w[:, None] * tl.exp2(s_log2 - lse[:, None])
        grad += tl.where(cols[None, :] == target[:, None], p - w[:, None], p)
    if COL_TERM:  # softmax over a for each column (row of b)
        lse = tl.load(lse_b_ptr + b_start + cols, mask=col_ok, other=0.0) * _LOG2E
        w = tl.load(w_b_ptr + b_start + cols, mask=col_ok, other=0.0)
        target = _local_index(tl.load(labels_b_ptr + b_start + cols, mask=col_ok, other=-1), a_label_start, M)
        p = w[None, :] * tl.exp2(s_log2 - lse[None, :])
        grad += tl.where(rows[:, None] == target[None, :], p - w[None, :], p)
    grad = grad * (G_RANGE / tl.load(w_max_ptr))
    g_ptrs = g_ptr + rows.to(tl.int64)[:, None] * stride_g + cols[None, :]
    if g_ptr.dtype.element_ty == tl.bfloat16:
        grad = _bf16(grad)  # rounded as the GPU rounds, also in the interpreter
    tl.store(g_ptrs, grad.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["x_start", "out_start", "accumulate"])
def _grad_product_kernel(x_ptr, g_ptr, out_ptr, w_max_ptr, M, N, K, stride_x, stride_gk, stride_gn, stride_out,
                         x_start, out_start, accumulate, G_RANGE: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                         PRECISION: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of ``out[out_start + n, m] (+)= w_max / G_RANGE * (X.T @ Gv)[m, n]``
    with ``X[k, m] = x[x_start + k, m]`` (m < M = D) and ``Gv[k, n] = g[k * stride_gk + n * stride_gn]``
    (G or its transpose, by strides). The input x (or its staged chunk) is the A operand, read
    through its transposed view (fp32 tiles pass through registers, where "bf16" rounds them); the
    G tile feeds the tensor cores from shared memory as loaded. One program per tile, no atomics."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    ms = (tl.program_id(0) % tiles_m) * BLOCK_M + tl.arange(0, BLOCK_M)
    ns = (tl.program_id(0) // tiles_m) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    m_ok = ms[:, None] < M
    n_ok = ns[None, :] < N
    x_ptrs = x_ptr + (x_start + ks).to(tl.int64)[None, :] * stride_x + ms[:, None]  # [BLOCK_M, BLOCK_K]
    g_ptrs = g_ptr + ks.to(tl.int64)[:, None] * stride_gk + ns.to(tl.int64)[None, :] * stride_gn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=m_ok, other=0.0)
            g = tl.load(g_ptrs, mask=n_ok, other=0.0)
        else:
            x = tl.load(x_ptrs, mask=m_ok & ((k0 + ks)[None, :] < K), other=0.0)
            g = tl.load(g_ptrs, mask=n_ok & ((k0 + ks)[:, None] < K), other=0.0)
        acc = _dot(x, g, acc, PRECISION)
        x_ptrs += BLOCK_K * stride_x
        g_ptrs += BLOCK_K * stride_gk
    acc = acc * (tl.load(w_max_ptr) / G_RANGE)
    out_ptrs = out_ptr + (out_start + ns).to(tl.int64)[None, :] * stride_out + ms[:, None]
    mask = m_ok & n_ok
    if accumulate != 0:
        acc += tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, acc, mask=mask)


# ----------------------------------------------------------------------------------------------------
# launchers


class TileConfig(NamedTuple):
    """Tiles of one kernel: BLOCK_M x BLOCK_N (capped by the problem), warps, pipeline stages, for
    the forward whether the column loop is flattened with the D loop (one software pipeline across
    column tiles), and BLOCK_K (None: 128 bytes of the loaded dtype, 32 fp32 or 64 16-bit elements)."""
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False
    block_k: int | None = None


# The winners of the sweeps at 65536 x 512 (timings: benchmarks/NOTES.md). 16-bit tiles (bf16/fp16
# inputs, or fp32 inputs staged in bf16): forward 128x128x64, 3 stages, the column loop flattened with
# the D loop; score gradient 128x64 for the symmetric loss (its three column vectors cost 32 registers
# each at 128 columns in the MMA layout: 252 registers at 128x128, 127 at 128x64), 128x128 for one
# direction; gradient products 128x256, 3 stages, 8192-chunks. K steps of 128 bytes of the input: 32
# fp32 elements keep fp32 G tiles (tf32/ieee) within shared memory. fp32 a rounded in registers: the
# forward unflattened at K 32 (the fp32 tiles leave the flattened pipeline).
DEFAULT_CONFIGS = {"fwd": TileConfig(flatten=True), "fwd_rounding": TileConfig(block_k=32),
                   "grad": TileConfig(128, 128), "grad_symmetric": TileConfig(128, 64),
                   "matmul": TileConfig(128, 256, 8, 3)}


def _block(n: int, cap: int) -> int:
    """The tile edge along an axis of n: cap, or the next power of two >= n (at least 16: tl.dot's minimum)."""
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def _tiles(config: TileConfig, M: int, N: int, a):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a [M, N] output of operands loaded like ``a``: K steps
    of ``config.block_k`` or 128 bytes; 4 warps for tiles smaller than the configured ones."""
    block_m, block_n = _block(M, config.block_m), _block(N, config.block_n)
    block_k = config.block_k or (64 if T.itemsize(a) == 2 else 32)
    warps = config.num_warps if block_m * block_n >= config.block_m * config.block_n else min(4, config.num_warps)
    return block_m, block_n, block_k, warps


def operand_dtype(dtype: str, precision: str) -> str:
    """The dtype the tensor cores read for inputs of ``dtype``: bfloat16 under "bf16" (float32 inputs
    rounded inside the kernels), else the input dtype. The G workspace takes it."""
    return "bfloat16" if precision == "bf16" else dtype


def _check_precision(precision: str, a) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS}, got {precision!r}")
    if precision == "bf16" and T.dtype_name(a) == "float16":
        raise ValueError("precision: 'bf16' rounds float32 (or bfloat16) operands; got float16 ones")


def _check_operands(a, b):
    for name, t in (("a", a), ("b", b)):
        if len(T.shape(t)) != 2:
            raise ValueError(f"{name}: expected a 2-D tensor [rows, D], got shape {T.shape(t)}")
        if T.dtype_name(t) not in T.FLOAT_DTYPES:
            raise TypeError(f"{name}: expected dtype in {list(T.FLOAT_DTYPES)}, got {T.dtype_name(t)}")
        if T.shape(t)[0] > 1 and T.shape(t)[1] > 1 and T.strides(t)[1] != 1:
            raise ValueError(f"{name}: last axis must be contiguous, got strides {T.strides(t)}")
    if T.dtype_name(a) != T.dtype_name(b):
        raise TypeError(f"b: expected the dtype of a ({T.dtype_name(a)}), got {T.dtype_name(b)}")
    if T.shape(a)[1] != T.shape(b)[1]:
        raise ValueError(f"b: expected D = {T.shape(a)[1]} (a's last axis), got shape {T.shape(b)}")
    return T.shape(a)[0], T.shape(b)[0], T.shape(a)[1]


# Staging (fp32 inputs under "bf16"): the launchers round chunks of b (``stage``) and of a
# (``stage_a``) into small bf16 buffers, so the score tiles feed the tensor cores from shared memory
# as 16-bit tiles; a tile rounded in registers instead costs fp32 traffic and, as the B operand, a
# round trip through shared memory. The buffers are constant in the batch. What the ops do by default:
STAGED_DEFAULT = True  # stage b
STAGE_A_DEFAULT = True  # stage a too
FWD_STAGE_ROWS = (32768, 16384)  # the forward's a and b chunks (the backward's are its G chunk's)


def stage_shape(N: int, D: int, chunk: int = GRAD_CHUNK):
    """Shape of a bf16 staging buffer for an input of N rows: [min(chunk, N), D]."""
    return (max(1, min(chunk, N)), D)


def _check_stage(name, stage, a, N, D, precision):
    """A staging buffer: bf16 [C, D] contiguous, 1 <= C <= N, only for fp32 inputs under "bf16";
    returns C (None without a buffer)."""
    if stage is None:
        return None
    if precision != "bf16" or T.dtype_name(a) != "float32":
        raise ValueError(f"{name}: only float32 inputs with precision 'bf16' are staged, got "
                         f"{T.dtype_name(a)} with {precision!r}")
    shape = T.shape(stage)
    if (len(shape) != 2 or shape[1] != D or not 1 <= shape[0] <= max(N, 1)
            or T.dtype_name(stage) != "bfloat16" or not T.is_contiguous(stage)):
        raise ValueError(f"{name}: expected a contiguous bfloat16 [C, {D}] buffer with 1 <= C <= {N}, got "
                         f"{T.dtype_name(stage)} {shape}")
    return shape[0]


def _stage(x, stage, start: int, rows: int) -> None:
    """stage[:rows] = bf16(x[start:start + rows])."""
    D = T.shape(x)[1]
    block_d = _block(D, 128)
    _stage_kernel[(triton.cdiv(rows, 32), triton.cdiv(D, block_d))](
        x, stage, start, rows, D, T.strides(x)[0], T.strides(stage)[0], BLOCK_R=32, BLOCK_D=block_d, num_warps=4)


def _chunks(x, stage, total: int, chunk: int | None = None):
    """(source, the chunk's first row in it, the chunk's first row in x, rows) for each ``chunk`` rows
    of an input x of ``total`` rows: with a ``stage`` buffer (whose rows are the chunk), each chunk
    rounded into it first; without, x itself (chunk default: all of x)."""
    chunk = T.shape(stage)[0] if stage is not None else (chunk or total)
    for start in range(0, total, chunk):
        rows = min(chunk, total - start)
        if stage is None:
            yield x, start, start, rows
        else:
            _stage(x, stage, start, rows)
            yield stage, 0, start, rows


def contrastive_lse_fwd(a, b, labels, lse, pos, scale: float, b_offset: int = 0, precision: str = "tf32",
                        config: TileConfig | None = None, stage=None, stage_a=None) -> None:
    """Row statistics of ``S = scale * a @ b.T`` for a [M, D], b [N, D]: ``lse[M]`` = logsumexp_j S[i, j]
    and ``pos[M]`` = S[i, labels[i] - b_offset] (0 where the label is outside [b_offset, b_offset + N)).
    labels [M] int32/int64; lse, pos [M] float32, contiguous; written in place. ``precision``: see
    the module docstring. ``stage`` / ``stage_a`` (fp32 inputs under "bf16"): bf16 [C, D] buffers
    (``stage_shape``) that b's / a's chunks are rounded into, one chunk at a time; the score tiles
    then read those chunks as bf16 (an unstaged fp32 input's tiles are rounded in registers)."""
    _check_precision(precision, a)
    M, N, D = _check_operands(a, b)
    _check_stage("stage", stage, a, N, D, precision)
    _check_stage("stage_a", stage_a, a, M, D, precision)
    T.check_same_shape("labels", labels, (M,))
    T.check_same_shape("lse", lse, (M,))
    T.check_same_shape("pos", pos, (M,))
    for name, t in (("lse", lse), ("pos", pos)):
        if T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected float32, got {T.dtype_name(t)}")
    if M == 0:
        return
    if N == 0:
        raise ValueError("b: expected at least one row (the log-sum-exp of nothing is -inf)")
    rounding = precision == "bf16" and stage_a is None and T.dtype_name(a) == "float32"
    config = config or DEFAULT_CONFIGS["fwd_rounding" if rounding else "fwd"]
    for a_src, _, a0, m in _chunks(a, stage_a, M):
        block_m, block_n, block_k, warps = _tiles(config, m, N, a_src)
        for b_src, _, b0, n in _chunks(b, stage, N):  # (b restaged for each chunk of a)
            _lse_fwd_kernel[(triton.cdiv(m, block_m),)](
                a_src, b_src, lse, m, n, D, T.strides(a_src)[0], T.strides(b_src)[0], a0, float(scale),
                BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=n % block_n == 0,
                EVEN_D=D % block_k == 0, PRECISION=precision, FLATTEN=config.flatten, ACCUMULATE=b0 > 0,
                num_warps=warps, num_stages=config.num_stages)
    _positive_kernel[(triton.cdiv(M, 32),)](a, b, labels, pos, M, N, D, T.strides(a)[0], T.strides(b)[0],
                                            int(b_offset), float(scale), BLOCK_M=32, BLOCK_D=_block(D, 128),
                                            PRECISION=precision, num_warps=4)


def _g_range(dtype: str) -> float:
    """G is stored as ``G * G_RANGE / w_max`` (|G| <= 2 w_max): for fp16, 2^14 keeps the typical entry
    (about w / batch) out of the subnormals while the largest stays far from fp16's 65504."""
    return 2.0**14 if dtype == "float16" else 1.0


def grad_workspace_shape(M: int, N: int, chunk: int = GRAD_CHUNK):
    """Shape of the G workspace ``contrastive_grad_accumulate`` takes for a [M, D], b [N, D]: chunks of
    ``chunk`` x ``chunk`` (fewer where the batch is smaller), whatever the batch: the backward's only
    scratch beyond per-row vectors."""
    return (max(1, min(chunk, M)), max(1, min(chunk, N)))


def contrastive_grad_accumulate(a, b, lse_a, lse_b, w_a, w_b, labels_a, labels_b, w_max, g_work, ua, ub,
                                scale: float, a_offset: int = 0, b_offset: int = 0, row_term: bool = True,
                                col_term: bool = False, accumulate_a: bool = False, accumulate_b: bool = False,
                                precision: str = "tf32", grad_config: TileConfig | None = None,
                                matmul_config: TileConfig | None = None, stage=None, stage_a=None) -> None:
    """Unscaled gradients of the loss through ``S = scale * a @ b.T``: ``ua (+)= G @ b``, ``ub (+)= G.T @ a``.

    a [M, D], b [N, D] (read in place, transposed views by strides); row term (``row_term``):
    lse_a, w_a [M] float32, labels_a [M] (global indices of b's rows, b[0] being ``b_offset``);
    column term (``col_term``): lse_b, w_b [N] float32, labels_b [N] (global indices of a's rows,
    a[0] being ``a_offset``). Tensors of a term that is off are not read (pass any). w_max [1]
    float32: a positive bound of |w_a| and |w_b| (G is stored divided by it, so fp16 keeps small
    weights such as 1/batch out of the subnormals). g_work: the workspace,
    ``grad_workspace_shape(M, N, chunk)`` in ``operand_dtype(a's dtype, precision)``, contiguous (its
    shape sets the chunk). ua [M, D], ub [N, D] float32: overwritten, or added to with
    ``accumulate_a``/``accumulate_b``. ``stage`` / ``stage_a``: as for ``contrastive_lse_fwd``, with
    exactly the G chunk's column / row count of rows (each chunk of b, and of a for each chunk of b,
    is rounded into it and read as bf16 by the score recompute and the product it enters).
    """
    _check_precision(precision, a)
    M, N, D = _check_operands(a, b)
    if not (row_term or col_term):
        raise ValueError("row_term, col_term: at least one direction of the loss must be on")
    if row_term:
        for name, t in (("lse_a", lse_a), ("w_a", w_a), ("labels_a", labels_a)):
            T.check_same_shape(name, t, (M,))
    if col_term:
        for name, t in (("lse_b", lse_b), ("w_b", w_b), ("labels_b", labels_b)):
            T.check_same_shape(name, t, (N,))
    for name, t, rows in (("ua", ua, M), ("ub", ub, N)):
        T.check_same_shape(name, t, (rows, D))
        if T.dtype_name(t) != "float32" or (rows > 1 and D > 1 and T.strides(t)[1] != 1):
            raise TypeError(f"{name}: expected float32 with a contiguous last axis, got {T.dtype_name(t)} "
                            f"strides {T.strides(t)}")
    T.check_same_shape("w_max", w_max, (1,))
    chunk_m, chunk_n = T.shape(g_work)
    if (chunk_m, chunk_n) != grad_workspace_shape(M, N, max(chunk_m, chunk_n)) or not T.is_contiguous(g_work):
        raise ValueError(f"g_work: expected a contiguous workspace of shape {grad_workspace_shape(M, N)}, "
                         f"got {T.shape(g_work)}")
    g_dtype = operand_dtype(T.dtype_name(a), precision)
    if T.dtype_name(g_work) != g_dtype:
        raise TypeError(f"g_work: expected {g_dtype} (the operand dtype), got {T.dtype_name(g_work)}")
    for name, buf, rows, chunk in (("stage", stage, N, chunk_n), ("stage_a", stage_a, M, chunk_m)):
        if buf is not None and _check_stage(name, buf, a, rows, D, precision) != chunk:
            raise ValueError(f"{name}: expected {chunk} rows (the G chunk's), got {T.shape(buf)}")
    if M == 0 or N == 0:
        return
    # statistics of a term that is off: any valid pointer will do (never dereferenced)
    lse_a, w_a, labels_a = (lse_a, w_a, labels_a) if row_term else (lse_b, w_b, labels_b)
    lse_b, w_b, labels_b = (lse_b, w_b, labels_b) if col_term else (lse_a, w_a, labels_a)
    grad_config = grad_config or DEFAULT_CONFIGS["grad_symmetric" if row_term and col_term else "grad"]
    matmul_config = matmul_config or DEFAULT_CONFIGS["matmul"]
    stride_g, g_range = T.strides(g_work)[0], _g_range(g_dtype)
    for b_src, b_row0, b0, cols in _chunks(b, stage, N, chunk_n):  # b's chunk outermost: staged once
        for a_src, a_row0, a0, rows in _chunks(a, stage_a, M, chunk_m):
            block_m, block_n, block_k, warps = _tiles(grad_config, rows, cols, a_src)
            _grad_scores_kernel[(triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))](
                a_src, b_src, lse_a, lse_b, w_a, w_b, labels_a, labels_b, w_max, g_work, a0, b0, a_row0, b_row0,
                rows, cols, D, T.strides(a_src)[0], T.strides(b_src)[0], stride_g, int(a_offset) + a0,
                int(b_offset) + b0, float(scale), ROW_TERM=bool(row_term), COL_TERM=bool(col_term),
                G_RANGE=g_range, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_D=D % block_k == 0,
                PRECISION=precision, num_warps=warps, num_stages=grad_config.num_stages)
            # ua[a0:a0+rows] (+)= (b[b0:b0+cols].T @ G.T).T;  ub[b0:b0+cols] (+)= (a[a0:a0+rows].T @ G).T
            for x, x_start, out, n, k, out_start, stride_gk, stride_gn, acc in (
                    (b_src, b_row0, ua, rows, cols, a0, 1, stride_g, accumulate_a or b0 > 0),
                    (a_src, a_row0, ub, cols, rows, b0, stride_g, 1, accumulate_b or a0 > 0)):
                block_m, block_n, block_k, warps = _tiles(matmul_config, D, n, x)
                _grad_product_kernel[(triton.cdiv(D, block_m) * triton.cdiv(n, block_n),)](
                    x, g_work, out, w_max, D, n, k, T.strides(x)[0], stride_gk, stride_gn, T.strides(out)[0],
                    x_start, out_start, int(acc), G_RANGE=g_range, BLOCK_M=block_m, BLOCK_N=block_n,
                    BLOCK_K=block_k, EVEN_K=k % block_k == 0, PRECISION=precision, num_warps=warps,
                    num_stages=matmul_config.num_stages)


def compile_cases():
    """Launches the compile-only check runs (SpecTensor arguments): at the canonical [65536, 512] each
    dtype as the ops run it (float32 rounded to bf16 in the kernels: unstaged, b staged, both staged;
    and tf32) (symmetric backward: both terms), and a tiny odd shape (masked D, 4-warp tiles)."""
    shapes = [(65536, 512, [("float32", "bf16", ""), ("float32", "bf16", "b"), ("float32", "bf16", "ab"),
                            ("float32", "tf32", ""), ("float16", "tf32", ""), ("bfloat16", "tf32", "")]),
              (37, 50, [("bfloat16", "tf32", ""), ("float32", "bf16", ""), ("float32", "bf16", "ab")])]
    for rows, D, cases in shapes:
        for dtype, precision, staged in cases:
            a, b = T.SpecTensor((rows, D), dtype), T.SpecTensor((rows, D), dtype)
            vec = T.SpecTensor((rows,), "float32")
            w_max = T.SpecTensor((1,), "float32")
            labels = T.SpecTensor((rows,), "int64")
            grads = T.SpecTensor((rows, D), "float32")
            work = T.SpecTensor(grad_workspace_shape(rows, rows), operand_dtype(dtype, precision))
            buffers = {}
            if "b" in staged:
                buffers["stage"] = T.SpecTensor(stage_shape(rows, D), "bfloat16")
            if "a" in staged:
                buffers["stage_a"] = T.SpecTensor(stage_shape(rows, D), "bfloat16")
            fwd_buffers = {name: T.SpecTensor(stage_shape(rows, D, chunk), "bfloat16")
                           for name, chunk in zip(("stage_a", "stage"), FWD_STAGE_ROWS) if name in buffers}
            tag = f"{dtype},{precision}{',staged ' + staged if staged else ''},{rows}x{D}"
            yield f"contrastive_lse_fwd[{tag}]", lambda a=a, b=b, v=vec, lab=labels, p=precision, st=fwd_buffers: \
                contrastive_lse_fwd(a, b, lab, v, v, 20.0, precision=p, **st)
            yield f"contrastive_grad_accumulate[{tag},symmetric]", \
                lambda a=a, b=b, v=vec, lab=labels, m=w_max, g=grads, w=work, p=precision, st=buffers: \
                contrastive_grad_accumulate(a, b, v, v, v, v, lab, lab, m, w, g, g, 20.0, row_term=True,
                                            col_term=True, precision=p, **st)
