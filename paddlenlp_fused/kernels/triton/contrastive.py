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
``ua[chunk rows] (+)= G @ b[chunk cols]`` and ``ub[chunk cols].T (+)= a.T[:, chunk rows] @ G``, fp32
(``a.T`` given transposed by the caller, so both products read K-major A and N-major B tiles). The
scores are recomputed once, so the whole step is 4 products of ``2 B^2 D`` FLOP (forward, recompute,
two gradients), plus ``6 B^2`` bytes of G traffic. ``ua``/``ub`` are the unscaled gradients:
``dA = scale * ua``, ``dB = scale * ub`` and ``dscale = sum(a * ua)`` (``sum_ij G_ij a_i.b_j =
sum_i a_i.(G b)_i``), which the caller forms.

Dtypes: a, b float32/float16/bfloat16 (the same); float32 operands run as ``precision`` says ("ieee"
exact, or "tf32"); a caller wanting bf16 tensor cores from fp32 inputs casts them first (one cheap
pass, instead of a convert inside every GEMM step). The G workspace has the operand dtype and holds
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
from .interpreter_compat import dot_operand

_LOG2E = tl.constexpr(1.4426950408889634)  # exp(x) = exp2(x * LOG2E): the kernels work in exp2
_LN2 = tl.constexpr(0.6931471805599453)
PRECISIONS = ("ieee", "tf32")
GRAD_CHUNK = 8192  # rows and columns of one materialised G chunk (faster than 4096 on the H200)


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
        acc = tl.dot(dot_operand(a), tl.trans(dot_operand(b)), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K
    return acc


@triton.jit(do_not_specialize=["M", "N"])
def _lse_fwd_kernel(a_ptr, b_ptr, lse_ptr, M, N, D, stride_a, stride_b, scale,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_N: tl.constexpr,
                    EVEN_D: tl.constexpr, PRECISION: tl.constexpr, FLATTEN: tl.constexpr):
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
    tl.store(lse_ptr + rows, (m_i + tl.log2(l_i)) * _LN2, mask=rows < M)


@triton.jit(do_not_specialize=["M", "N", "b_offset"])
def _positive_kernel(a_ptr, b_ptr, labels_ptr, pos_ptr, M, N, D, stride_a, stride_b, b_offset, scale,
                     BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
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
        a = tl.load(a_ptrs, mask=mask, other=0.0).to(tl.float32)
        acc += a * tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
        a_ptrs += BLOCK_D
        b_ptrs += BLOCK_D
    tl.store(pos_ptr + rows, tl.sum(acc, axis=1) * scale, mask=row_ok)


@triton.jit
def _local_index(labels, start, n):
    """labels - start as int32 where it falls in [0, n), else -1 (compares stay 32-bit in the tile)."""
    local = labels.to(tl.int64) - start
    return tl.where((local >= 0) & (local < n), local, -1).to(tl.int32)


@triton.jit(do_not_specialize=["a_start", "b_start", "a_label_start", "b_label_start"])
def _grad_scores_kernel(a_ptr, b_ptr, lse_a_ptr, lse_b_ptr, w_a_ptr, w_b_ptr, labels_a_ptr, labels_b_ptr,
                        w_max_ptr, g_ptr, a_start, b_start, M, N, D, stride_a, stride_b, stride_g,
                        a_label_start, b_label_start, scale,
                        ROW_TERM: tl.constexpr, COL_TERM: tl.constexpr, G_RANGE: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        EVEN_D: tl.constexpr, PRECISION: tl.constexpr):
    """G[i, j] * G_RANGE / w_max for a[a_start + i], b[b_start + j], i < M, j < N, into g[i, j]."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < M
    col_ok = cols < N
    dots = _score_tile(a_ptr + a_start.to(tl.int64) * stride_a, b_ptr + b_start.to(tl.int64) * stride_b,
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
    tl.store(g_ptrs, grad.to(g_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _matmul_tile(a_ptr, b_ptr, out_ptr, w_max_ptr, tile, M, N, K, stride_a, stride_b, stride_out, a_k_start,
                 b_k_start, out_start, accumulate, TRANS_OUT: tl.constexpr, G_RANGE: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                 PRECISION: tl.constexpr):
    """One [BLOCK_M, BLOCK_N] tile of C = w_max / G_RANGE * A @ B, A[m, k] = a[m, a_k_start + k] and
    B[k, n] = b[b_k_start + k, n] both row-major (K-major A, N-major B: the layouts whose loads the
    sm_90 pipeliner turns into async copies; a transposed view of A is loaded synchronously there).
    C is added to (``accumulate``) or written into out[out_start + m, n], or with TRANS_OUT
    out[out_start + n, m]."""
    tiles_n = tl.cdiv(N, BLOCK_N)
    rows = (tile // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = (tile % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok = rows[:, None] < M
    col_ok = cols[None, :] < N
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_a + (a_k_start + ks)[None, :]
    b_ptrs = b_ptr + (b_k_start + ks).to(tl.int64)[:, None] * stride_b + cols[None, :]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            a = tl.load(a_ptrs, mask=row_ok, other=0.0)
            b = tl.load(b_ptrs, mask=col_ok, other=0.0)
        else:
            a = tl.load(a_ptrs, mask=row_ok & ((k0 + ks)[None, :] < K), other=0.0)
            b = tl.load(b_ptrs, mask=col_ok & ((k0 + ks)[:, None] < K), other=0.0)
        acc = tl.dot(dot_operand(a), dot_operand(b), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K
        b_ptrs += BLOCK_K * stride_b
    acc = acc * (tl.load(w_max_ptr) / G_RANGE)
    if TRANS_OUT:
        out_ptrs = out_ptr + (out_start + cols).to(tl.int64)[None, :] * stride_out + rows[:, None]
    else:
        out_ptrs = out_ptr + (out_start + rows).to(tl.int64)[:, None] * stride_out + cols[None, :]
    mask = row_ok & col_ok
    if accumulate != 0:
        acc += tl.load(out_ptrs, mask=mask, other=0.0)
    tl.store(out_ptrs, acc, mask=mask)


@triton.jit(do_not_specialize=["out_start", "accumulate"])
def _matmul_kernel(a_ptr, b_ptr, out_ptr, w_max_ptr, M, N, K, stride_a, stride_b, stride_out, a_k_start, b_k_start,
                   out_start, accumulate, TRANS_OUT: tl.constexpr, G_RANGE: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """One product of a G chunk per launch. (Both products as two branches of one kernel leave the
    second branch's loads out of the software pipeline on sm_90: synchronous loads, TTGIR.)"""
    _matmul_tile(a_ptr, b_ptr, out_ptr, w_max_ptr, tl.program_id(0), M, N, K, stride_a, stride_b, stride_out,
                 a_k_start, b_k_start, out_start, accumulate, TRANS_OUT, G_RANGE, BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K,
                 PRECISION)


# ----------------------------------------------------------------------------------------------------
# launchers


class TileConfig(NamedTuple):
    """Tiles of one kernel: BLOCK_M x BLOCK_N (capped by the problem), warps, pipeline stages and, for
    the forward, whether the column loop is flattened with the D loop (one software pipeline across
    column tiles)."""
    block_m: int = 128
    block_n: int = 128
    num_warps: int = 8
    num_stages: int = 3
    flatten: bool = False


# Fastest in the H200 sweeps of benchmarks/cases/contrastive.py at 65536 x 512 (bf16 operands).
# Forward (first run, 2026-11-30): 128x128x64 tiles, 3 stages, column loop flattened with the D loop
# (one software pipeline across column tiles) 10.5 ms; unflattened 11.5; flattened with 4 stages
# 21.4; 128x64 flattened 27.5. Score gradient: 128x64 (54.3 ms for the whole backward then, 55.2
# with 128x128; its three column vectors of the symmetric term cost 32 registers each at 128
# columns in the MMA layout, 252 registers at 128x128 against 127 at 128x64). GEMMs: 128x128 with
# 4 stages and 8192-chunks (second run, results/contrastive.json "sweep": backward 31.3 ms; 3
# stages 33.2; 4096-chunks 42.9).
DEFAULT_CONFIGS = {"fwd": TileConfig(flatten=True), "grad": TileConfig(128, 64),
                   "grad_symmetric": TileConfig(128, 64), "matmul": TileConfig(num_stages=4)}


def _block(n: int, cap: int) -> int:
    """The tile edge along an axis of n: cap, or the next power of two >= n (at least 16: tl.dot's minimum)."""
    return max(16, min(cap, triton.next_power_of_2(max(n, 1))))


def _tiles(config: TileConfig, M: int, N: int, a):
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for a [M, N] output of operands like ``a``: K steps of
    128 bytes (64 in 16-bit, 32 in fp32); 4 warps for tiles smaller than the configured ones."""
    block_m, block_n = _block(M, config.block_m), _block(N, config.block_n)
    block_k = 64 if T.itemsize(a) == 2 else 32
    warps = config.num_warps if block_m * block_n >= config.block_m * config.block_n else min(4, config.num_warps)
    return block_m, block_n, block_k, warps


def _check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise ValueError(f"precision: expected one of {PRECISIONS} (fp32 operands), got {precision!r}")


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


def contrastive_lse_fwd(a, b, labels, lse, pos, scale: float, b_offset: int = 0, precision: str = "tf32",
                        config: TileConfig | None = None) -> None:
    """Row statistics of ``S = scale * a @ b.T`` for a [M, D], b [N, D]: ``lse[M]`` = logsumexp_j S[i, j]
    and ``pos[M]`` = S[i, labels[i] - b_offset] (0 where the label is outside [b_offset, b_offset + N)).
    labels [M] int32/int64; lse, pos [M] float32, contiguous; written in place."""
    _check_precision(precision)
    M, N, D = _check_operands(a, b)
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
    config = config or DEFAULT_CONFIGS["fwd"]
    block_m, block_n, block_k, warps = _tiles(config, M, N, a)
    _lse_fwd_kernel[(triton.cdiv(M, block_m),)](
        a, b, lse, M, N, D, T.strides(a)[0], T.strides(b)[0], float(scale),
        BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_N=N % block_n == 0, EVEN_D=D % block_k == 0,
        PRECISION=precision, FLATTEN=config.flatten, num_warps=warps, num_stages=config.num_stages)
    _positive_kernel[(triton.cdiv(M, 32),)](a, b, labels, pos, M, N, D, T.strides(a)[0], T.strides(b)[0],
                                            int(b_offset), float(scale), BLOCK_M=32, BLOCK_D=_block(D, 128),
                                            num_warps=4)


def _g_range(g) -> float:
    """G is stored as ``G * G_RANGE / w_max`` (|G| <= 2 w_max): for fp16, 2^14 keeps the typical entry
    (about w / batch) out of the subnormals while the largest stays far from fp16's 65504."""
    return 2.0**14 if T.dtype_name(g) == "float16" else 1.0


def grad_workspace_shape(M: int, N: int, chunk: int = GRAD_CHUNK):
    """Shape of the G workspace ``contrastive_grad_accumulate`` takes for a [M, D], b [N, D]: chunks of
    ``chunk`` x ``chunk`` (fewer where the batch is smaller)."""
    return (max(1, min(chunk, M)), max(1, min(chunk, N)))


def contrastive_grad_accumulate(a, a_t, b, lse_a, lse_b, w_a, w_b, labels_a, labels_b, w_max, g_work, ua, ub,
                                scale: float, a_offset: int = 0, b_offset: int = 0, row_term: bool = True,
                                col_term: bool = False, accumulate_a: bool = False, accumulate_b: bool = False,
                                precision: str = "tf32", grad_config: TileConfig | None = None,
                                matmul_config: TileConfig | None = None) -> None:
    """Unscaled gradients of the loss through ``S = scale * a @ b.T``: ``ua (+)= G @ b``, ``ub (+)= G.T @ a``.

    a [M, D], a_t = a.T [D, M] contiguous (the second product reads a transposed; a caller
    transposes once per backward, not once per block), b [N, D]; row term (``row_term``): lse_a,
    w_a [M] float32, labels_a [M] (global indices of b's rows, b[0] being ``b_offset``); column term
    (``col_term``): lse_b, w_b [N] float32, labels_b [N] (global indices of a's rows, a[0] being
    ``a_offset``). Tensors of a term that is off are not read (pass any). w_max [1] float32: a
    positive bound of |w_a| and |w_b| (G is stored divided by it, so fp16 keeps small weights such
    as 1/batch out of the subnormals). g_work: the workspace, ``grad_workspace_shape(M, N, chunk)``
    in a's dtype, contiguous (its shape sets the chunk).
    ua [M, D], ub [N, D] float32: overwritten, or added to with ``accumulate_a``/``accumulate_b``.
    """
    _check_precision(precision)
    M, N, D = _check_operands(a, b)
    if not (row_term or col_term):
        raise ValueError("row_term, col_term: at least one direction of the loss must be on")
    if row_term:
        for name, t in (("lse_a", lse_a), ("w_a", w_a), ("labels_a", labels_a)):
            T.check_same_shape(name, t, (M,))
    if col_term:
        for name, t in (("lse_b", lse_b), ("w_b", w_b), ("labels_b", labels_b)):
            T.check_same_shape(name, t, (N,))
    T.check_same_shape("a_t", a_t, (D, M))
    if not T.is_contiguous(a_t) or T.dtype_name(a_t) != T.dtype_name(a):
        raise ValueError(f"a_t: expected a contiguous {T.dtype_name(a)} [D, M] transpose of a, got "
                         f"{T.dtype_name(a_t)} strides {T.strides(a_t)}")
    for name, t, rows in (("ua", ua, M), ("ub", ub, N)):
        T.check_same_shape(name, t, (rows, D))
        if T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected float32, got {T.dtype_name(t)}")
    T.check_same_shape("w_max", w_max, (1,))
    chunk_m, chunk_n = T.shape(g_work)
    if (chunk_m, chunk_n) != grad_workspace_shape(M, N, max(chunk_m, chunk_n)) or not T.is_contiguous(g_work):
        raise ValueError(f"g_work: expected a contiguous workspace of shape {grad_workspace_shape(M, N)}, "
                         f"got {T.shape(g_work)}")
    if T.dtype_name(g_work) != T.dtype_name(a):
        raise TypeError(f"g_work: expected the dtype of a ({T.dtype_name(a)}), got {T.dtype_name(g_work)}")
    if M == 0 or N == 0:
        return
    # statistics of a term that is off: any valid pointer will do (never dereferenced)
    lse_a, w_a, labels_a = (lse_a, w_a, labels_a) if row_term else (lse_b, w_b, labels_b)
    lse_b, w_b, labels_b = (lse_b, w_b, labels_b) if col_term else (lse_a, w_a, labels_a)
    grad_config = grad_config or DEFAULT_CONFIGS["grad_symmetric" if row_term and col_term else "grad"]
    matmul_config = matmul_config or DEFAULT_CONFIGS["matmul"]
    stride_g, g_range = T.strides(g_work)[0], _g_range(g_work)
    for a0 in range(0, M, chunk_m):
        rows = min(chunk_m, M - a0)
        for b0 in range(0, N, chunk_n):
            cols = min(chunk_n, N - b0)
            block_m, block_n, block_k, warps = _tiles(grad_config, rows, cols, a)
            _grad_scores_kernel[(triton.cdiv(rows, block_m), triton.cdiv(cols, block_n))](
                a, b, lse_a, lse_b, w_a, w_b, labels_a, labels_b, w_max, g_work, a0, b0, rows, cols,
                D, T.strides(a)[0], T.strides(b)[0], stride_g, int(a_offset) + a0, int(b_offset) + b0,
                float(scale), ROW_TERM=bool(row_term), COL_TERM=bool(col_term),
                G_RANGE=g_range, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, EVEN_D=D % block_k == 0,
                PRECISION=precision, num_warps=warps, num_stages=grad_config.num_stages)
            # ua[a0:a0+rows] (+)= G @ b[b0:b0+cols];  ub[b0:b0+cols].T (+)= a_t[:, a0:a0+rows] @ G
            for x, y, out, m, n, k, x_start, y_start, out_start, acc, trans in (
                    (g_work, b, ua, rows, D, cols, 0, b0, a0, accumulate_a or b0 > 0, False),
                    (a_t, g_work, ub, D, cols, rows, a0, 0, b0, accumulate_b or a0 > 0, True)):
                block_m, block_n, block_k, warps = _tiles(matmul_config, m, n, a)
                _matmul_kernel[(triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)](
                    x, y, out, w_max, m, n, k, T.strides(x)[0], T.strides(y)[0], T.strides(out)[0],
                    x_start, y_start, out_start, int(acc), TRANS_OUT=trans, G_RANGE=g_range, BLOCK_M=block_m,
                    BLOCK_N=block_n, BLOCK_K=block_k, EVEN_K=k % block_k == 0, PRECISION=precision,
                    num_warps=warps, num_stages=matmul_config.num_stages)


def compile_cases():
    """Launches the compile-only check runs (SpecTensor arguments): each dtype at the canonical
    [65536, 512] (symmetric backward: both terms), and a tiny odd shape (masked D, 4-warp tiles)."""
    shapes = [(65536, 512, T.FLOAT_DTYPES), (37, 50, ("bfloat16",))]
    for rows, D, dtypes in shapes:
        for dtype in dtypes:
            a, b = T.SpecTensor((rows, D), dtype), T.SpecTensor((rows, D), dtype)
            a_t = T.SpecTensor((D, rows), dtype)
            vec = T.SpecTensor((rows,), "float32")
            w_max = T.SpecTensor((1,), "float32")
            labels = T.SpecTensor((rows,), "int64")
            grads = T.SpecTensor((rows, D), "float32")
            work = T.SpecTensor(grad_workspace_shape(rows, rows), dtype)
            yield f"contrastive_lse_fwd[{dtype},{rows}x{D}]", \
                lambda a=a, b=b, v=vec, lab=labels: contrastive_lse_fwd(a, b, lab, v, v, 20.0)
            yield f"contrastive_grad_accumulate[{dtype},{rows}x{D},symmetric]", \
                lambda a=a, a_t=a_t, b=b, v=vec, lab=labels, m=w_max, g=grads, w=work: contrastive_grad_accumulate(
                    a, a_t, b, v, v, v, v, lab, lab, m, w, g, g, 20.0, row_term=True, col_term=True)
