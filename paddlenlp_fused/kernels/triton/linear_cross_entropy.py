"""Linear cross-entropy: the loss of ``logits = hidden @ W^T (+ bias)`` without ``[T, V]`` logits.

Shapes (T tokens, D hidden, V vocabulary rows held by this rank):
    hidden ``[T, D]``; weight ``[V, D]`` (``transpose_y=True``) or ``[D, V]`` (``transpose_y=False``),
    read through the pair ``(stride_wv, stride_wd)`` so both layouts take the same kernels;
    bias ``[V]``; labels ``[T]`` int (global vocabulary ids; this rank holds ``[vocab_start,
    vocab_start + V)``).

Per token, with ``a = h W^T + b`` and ``s = softcap(a) = c tanh(a / c)`` (or ``s = a``):
    lse = log sum_v exp(s_v);  loss = lse - (1 - eps) s_y - eps / V_total * sum_v s_v + z lse^2.

Forward (one GEMM-equivalent): ``lse_partials`` tiles tokens x vocabulary, computes each logit tile
on the tensor cores (fp32 accumulation) and folds it into an online max / sum-exp, the target logit
and the logit sum; ``combine_partials`` merges the vocabulary splits into per-token ``stats [3, T]``
(lse, target logit, logit sum of this rank's vocabulary); ``token_loss`` turns (all-reduced) stats
into the per-token loss.

Backward (three GEMM-equivalents), over vocabulary chunks of ``Vc`` rows so that scratch stays
``T * Vc`` elements: ``grad_logits`` recomputes the chunk's logits and writes
``G = f'(a) * (coef_p * softmax - coef_y * ((1 - eps) onehot + eps / V_total))`` (``[T, Vc]``, input
dtype); ``dW[chunk] = G^T h`` is complete in one GEMM (no atomics); ``dh += G W[chunk]`` is accumulated
over chunks in fp32 registers and stored compensated (bf16/fp16 ``hi`` in dh plus a ``lo`` residual
buffer), so the sum over ~V/Vc chunks keeps fp32-like accuracy (no atomics: the chunks add in order).
The bias gradient is a column sum of G (fp32 atomics, then ``scale_cast``); deterministic
(``dbias_parts``): each token block's column sums go to its own row of a float32 workspace
``[token blocks, Vc]``, added in row order after each chunk (``partial_sums.add_parts``). The
chunked paths below do the same for their dbias.

Optional gradient filter (approximate, opt-in): a G tile whose entries are all below ``filter_eps`` is
flagged, and the gradient GEMMs (dh, dW: each selectable) skip flagged blocks; the bias gradient is
never filtered.
``filter_eps=None`` is the exact mode.

The chunked paths further down (``lean_*``, ``bounded_*``) take their GEMMs from the caller (cuBLASLt
on the GPU) and run only the softmax / cross-entropy work on logits chunks here.
"""

from __future__ import annotations

from typing import NamedTuple

import triton
import triton.language as tl

from ...runtime import tensor as T
from . import linear_cross_entropy_tuning as tuning
from .interpreter_compat import INTERPRETING, dot_operand
from .partial_sums import add_parts

NUM_SMS_GUESS = 132  # H100/H200; only shapes the forward's split count
MAX_SPLITS = 48
DEFAULT_CHUNK_BYTES = 32 * 2**20  # the backward's G workspace
# "auto" filter threshold: the input dtype's machine epsilon / 32 (Cut Cross-Entropy's rule): 2^-12 in
# bf16, 2^-15 in fp16, 2^-28 in fp32.
AUTO_FILTER_EPS = {"bfloat16": 2.0**-12, "float16": 2.0**-15, "float32": 2.0**-28}


class TileConfig(NamedTuple):
    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int


class Tiles(NamedTuple):
    """Tile configs of the three GEMM kernels: the forward's logit tiles (``block_m`` tokens x
    ``block_n`` vocabulary), the backward's G tiles (which also set the filter-flag blocks), and the
    dW / dh products."""
    forward: TileConfig
    grad: TileConfig
    matmul: TileConfig


def default_tiles(dtype: str) -> Tiles:
    """Fixed configs (no autotuning: predictable compile time). 16-bit inputs: the fastest of a
    sweep at T=8192, D=4096, V=128256 (each backward config checked against fp32 gradients; figures
    in benchmarks/NOTES.md). fp32 runs on CUDA cores in IEEE precision, in small tiles. The
    interpreter takes small tiles for speed."""
    if INTERPRETING:
        cfg = TileConfig(16, 32, 16, 4, 1, 1)
        return Tiles(cfg, cfg, cfg)
    if dtype == "float32":
        cfg = TileConfig(64, 64, 16, 8, 4, 2)
        return Tiles(cfg._replace(group_m=16), cfg, cfg)
    return Tiles(TileConfig(128, 256, 64, 16, 8, 3), TileConfig(256, 128, 64, 8, 8, 3),
                 TileConfig(128, 256, 64, 8, 8, 4))


# ----------------------------------------------------------------------------------------------
# device helpers


@triton.jit
def _tile_mm(a_ptr, b_ptr, rows, cols, K, stride_am, stride_ak, stride_bk, stride_bn,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
             EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """acc[BLOCK_M, BLOCK_N] = A[rows, :K] @ B[:K, cols] in fp32; rows/cols already in range."""
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rows.to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
    b_ptrs = b_ptr + offs_k[:, None] * stride_bk + cols.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        if EVEN_K:
            a = tl.load(a_ptrs)
            b = tl.load(b_ptrs)
        else:
            k_left = K - k * BLOCK_K
            a = tl.load(a_ptrs, mask=offs_k[None, :] < k_left, other=0.0)
            b = tl.load(b_ptrs, mask=offs_k[:, None] < k_left, other=0.0)
        acc = tl.dot(dot_operand(a), dot_operand(b), acc, input_precision=PRECISION)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk
    return acc


@triton.jit
def _grouped_pid(pid, num_m, num_n, GROUP_M: tl.constexpr):
    """Tile (m, n) of program ``pid``, GROUP_M m-tiles per band so running tiles share operands in L2."""
    in_group = GROUP_M * num_n
    first_m = (pid // in_group) * GROUP_M
    size_m = tl.minimum(num_m - first_m, GROUP_M)
    pid_m = first_m + (pid % in_group) % size_m
    pid_n = (pid % in_group) // size_m
    return pid_m, pid_n


@triton.jit
def _tanh(x):
    # 1 - 2 / (exp(2x) + 1): saturates cleanly to +-1 (exp overflow -> inf -> 1).
    return 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0)


@triton.jit
def _logits(acc, bias_ptr, cols, softcap, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr):
    """s = softcap(acc + bias) for a tile; ``cols`` are in-range vocabulary rows."""
    a = acc
    if HAS_BIAS:
        a = a + tl.load(bias_ptr + cols).to(tl.float32)[None, :]
    if SOFTCAP:
        a = softcap * _tanh(a / softcap)
    return a


# ----------------------------------------------------------------------------------------------
# forward


@triton.jit
def _fold_tile(h_ptr, w_ptr, bias_ptr, rows, labels, vt, m_i, l_i, tgt, total, V, D,
               stride_ht, stride_hd, stride_wv, stride_wd, softcap,
               HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, NEED_SUM: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
               EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """Folds vocabulary tile ``vt`` into the running (max, sum-exp, target logit, logit sum)."""
    offs_n = vt * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = offs_n % V
    acc = _tile_mm(h_ptr, w_ptr, rows, cols, D, stride_ht, stride_hd, stride_wd, stride_wv,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    s = _logits(acc, bias_ptr, cols, softcap, HAS_BIAS, SOFTCAP)
    in_vocab = (offs_n < V)[None, :]
    s_masked = tl.where(in_vocab, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s_masked, 1))
    l_i = l_i * tl.exp(m_i - m_new) + tl.sum(tl.exp(s_masked - m_new[:, None]), 1)
    tgt += tl.sum(tl.where(in_vocab & (offs_n[None, :] == labels[:, None]), s, 0.0), 1)
    if NEED_SUM:
        total += tl.sum(tl.where(in_vocab, s, 0.0), 1)
    return m_new, l_i, tgt, total


@triton.jit
def _lse_partials_kernel(h_ptr, w_ptr, bias_ptr, labels_ptr, part_ptr,
                         n_tok, V, D, vocab_start, n_tblk, n_split, tiles_per_split, n_vtiles,
                         stride_ht, stride_hd, stride_wv, stride_wd, stride_label, softcap,
                         HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, NEED_SUM: tl.constexpr,
                         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                         GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """Program (token block, vocabulary split): loops over the split's vocabulary tiles, folding each
    logit tile into (max, sum-exp, target logit, logit sum); writes part[4, n_split, n_tok]."""
    tblk, split = _grouped_pid(tl.program_id(0), n_tblk, n_split, GROUP_M)
    offs_m = tblk * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = offs_m % n_tok
    labels = tl.load(labels_ptr + rows.to(tl.int64) * stride_label).to(tl.int64) - vocab_start
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    tgt = tl.zeros([BLOCK_M], tl.float32)
    total = tl.zeros([BLOCK_M], tl.float32)
    vt_start = split * tiles_per_split
    for vt in range(vt_start, tl.minimum(vt_start + tiles_per_split, n_vtiles)):
        m_i, l_i, tgt, total = _fold_tile(
            h_ptr, w_ptr, bias_ptr, rows, labels, vt, m_i, l_i, tgt, total, V, D,
            stride_ht, stride_hd, stride_wv, stride_wd, softcap, HAS_BIAS, SOFTCAP, NEED_SUM,
            BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    plane = n_split * n_tok
    out = part_ptr + split * n_tok + offs_m
    keep = offs_m < n_tok
    tl.store(out, m_i, mask=keep)
    tl.store(out + plane, l_i, mask=keep)
    tl.store(out + 2 * plane, tgt, mask=keep)
    tl.store(out + 3 * plane, total, mask=keep)


@triton.jit
def _combine_kernel(part_ptr, stats_ptr, n_tok, n_split, BLOCK: tl.constexpr):
    """stats[0] = lse, stats[1] = target logit, stats[2] = logit sum over this rank's vocabulary."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n_tok
    plane = n_split * n_tok
    m = tl.full([BLOCK], float("-inf"), tl.float32)
    for s in range(0, n_split):
        m = tl.maximum(m, tl.load(part_ptr + s * n_tok + offs, mask=keep, other=0.0))
    l_sum = tl.zeros([BLOCK], tl.float32)
    tgt = tl.zeros([BLOCK], tl.float32)
    total = tl.zeros([BLOCK], tl.float32)
    for s in range(0, n_split):
        ptr = part_ptr + s * n_tok + offs
        m_s = tl.load(ptr, mask=keep, other=0.0)
        l_sum += tl.load(ptr + plane, mask=keep, other=0.0) * tl.exp(m_s - m)  # empty split: exp(-inf)
        tgt += tl.load(ptr + 2 * plane, mask=keep, other=0.0)
        total += tl.load(ptr + 3 * plane, mask=keep, other=0.0)
    tl.store(stats_ptr + offs, m + tl.log(l_sum), mask=keep)
    tl.store(stats_ptr + n_tok + offs, tgt, mask=keep)
    tl.store(stats_ptr + 2 * n_tok + offs, total, mask=keep)


@triton.jit
def _token_loss_kernel(stats_ptr, labels_ptr, loss_ptr, flag_ptr, n_tok, row0, stats_plane, vocab_total,
                       ignore_index, stride_label, label_smoothing, z_loss, BLOCK: tl.constexpr):
    """loss = lse - (1-eps) s_y - eps/V sum(s) + z lse^2 for tokens row0 + i (stats column i), 0 for
    ignored ones; a label outside [0, vocab_total) gives NaN and is stored in ``flag`` (which the caller
    set to ignore_index and reads once, without a sync per kernel)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n_tok
    lse = tl.load(stats_ptr + offs, mask=keep, other=0.0)
    tgt = tl.load(stats_ptr + stats_plane + offs, mask=keep, other=0.0)
    total = tl.load(stats_ptr + 2 * stats_plane + offs, mask=keep, other=0.0)
    rows = (row0 + offs).to(tl.int64)
    label = tl.load(labels_ptr + rows * stride_label, mask=keep, other=ignore_index).to(tl.int64)
    loss = lse - (1.0 - label_smoothing) * tgt - (label_smoothing / vocab_total) * total + z_loss * lse * lse
    bad = (label != ignore_index) & ((label < 0) | (label >= vocab_total))
    loss = tl.where(bad, float("nan"), loss)
    loss = tl.where(label == ignore_index, 0.0, loss)
    tl.store(loss_ptr + rows, loss, mask=keep)
    tl.store(flag_ptr + tl.zeros_like(offs), label, mask=keep & bad)


# ----------------------------------------------------------------------------------------------
# backward


@triton.jit
def _grad_logits_kernel(h_ptr, w_ptr, bias_ptr, labels_ptr, lse_ptr, coef_p_ptr, coef_y_ptr,
                        g_ptr, dbias_ptr, flag_ptr,
                        n_tok, D, chunk_start, chunk_len, vocab_start, vocab_total,
                        stride_ht, stride_hd, stride_wv, stride_wd, stride_label, stride_gt, stride_flag,
                        softcap, label_smoothing, filter_eps,
                        HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr, FILTER: tl.constexpr,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                        GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr,
                        ld_parts=0, DETERMINISTIC: tl.constexpr = False):
    """G[t, j] for vocabulary rows chunk_start + j (j < chunk_len) of this rank:
    f'(a) * (coef_p[t] * exp(s - lse[t]) - coef_y[t] * ((1-eps) [label == v] + eps / V_total)).
    DETERMINISTIC: dbias_ptr is the workspace [token blocks, ld_parts] of this chunk's column sums."""
    num_m = tl.cdiv(n_tok, BLOCK_M)
    num_n = tl.cdiv(chunk_len, BLOCK_N)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rows = offs_m % n_tok
    cols = chunk_start + offs_n % chunk_len
    acc = _tile_mm(h_ptr, w_ptr, rows, cols, D, stride_ht, stride_hd, stride_wd, stride_wv,
                   BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    s = _logits(acc, bias_ptr, cols, softcap, HAS_BIAS, SOFTCAP)
    lse = tl.load(lse_ptr + rows)
    coef_p = tl.load(coef_p_ptr + rows)
    coef_y = tl.load(coef_y_ptr + rows)
    label = tl.load(labels_ptr + rows.to(tl.int64) * stride_label).to(tl.int64) - vocab_start
    onehot = tl.where(cols[None, :] == label[:, None], 1.0 - label_smoothing, 0.0) + label_smoothing / vocab_total
    grad = coef_p[:, None] * tl.exp(s - lse[:, None]) - coef_y[:, None] * onehot
    if SOFTCAP:
        capped = s / softcap
        grad = grad * (1.0 - capped * capped)
    inside = (offs_m < n_tok)[:, None] & (offs_n < chunk_len)[None, :]
    grad = tl.where(inside, grad, 0.0)
    if FILTER:
        keep = tl.max(tl.max(tl.abs(grad), 1), 0) >= filter_eps
        tl.store(flag_ptr + pid_m * stride_flag + pid_n, keep.to(tl.int8))
    # 64-bit tile base, 32-bit offsets inside the tile (fewer registers in the epilogue)
    g_tile = g_ptr + (pid_m * BLOCK_M).to(tl.int64) * stride_gt + pid_n * BLOCK_N
    local = tl.arange(0, BLOCK_M)[:, None] * stride_gt + tl.arange(0, BLOCK_N)[None, :]
    tl.store(g_tile + local, grad.to(g_ptr.dtype.element_ty), mask=inside)
    if HAS_BIAS and DETERMINISTIC:
        tl.store(dbias_ptr + pid_m * ld_parts + offs_n, tl.sum(grad, 0), mask=offs_n < chunk_len)
    elif HAS_BIAS:
        tl.atomic_add(dbias_ptr + cols, tl.sum(grad, 0), mask=offs_n < chunk_len)


@triton.jit
def _matmul_kernel(a_ptr, b_ptr, c_ptr, lo_ptr, scale_ptr, flag_ptr,
                   M, N, K, a_offset, b_offset, c_offset,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_cn, stride_flag,
                   FLAG_ROWS: tl.constexpr, FLAG_COLS: tl.constexpr,
                   EPILOGUE: tl.constexpr, FIRST: tl.constexpr, LAST: tl.constexpr, FILTER_MODE: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, EVEN_K: tl.constexpr, PRECISION: tl.constexpr):
    """C = scale * A @ B with fp32 accumulation, then by EPILOGUE:
    0 store C (cast); 1 C += (fp32 C); 2 compensated: hi (C, 16-bit) + lo (residual) += ..., and on
    the LAST call only hi = round(total) is stored. FIRST: the old C/lo are not read.
    FILTER_MODE (which operand is G [tokens, vocab], whose tile flags are [t / FLAG_ROWS, v / FLAG_COLS]):
    0 none; 1 A = G (m tokens, k vocab); 2 A = G^T (m vocab, k tokens); 3 B = G (k tokens, n vocab)."""
    num_m = tl.cdiv(M, BLOCK_M)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = _grouped_pid(tl.program_id(0), num_m, num_n, GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    a_ptr += a_offset
    b_ptr += b_offset
    if FILTER_MODE == 0:
        acc = _tile_mm(a_ptr, b_ptr, offs_m % M, offs_n % N, K, stride_am, stride_ak, stride_bk, stride_bn,
                       BLOCK_M, BLOCK_N, BLOCK_K, EVEN_K, PRECISION)
    else:
        offs_k = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + (offs_m % M).to(tl.int64)[:, None] * stride_am + offs_k[None, :] * stride_ak
        b_ptrs = b_ptr + offs_k[:, None] * stride_bk + (offs_n % N).to(tl.int64)[None, :] * stride_bn
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in range(0, tl.cdiv(K, BLOCK_K)):
            k0 = k * BLOCK_K
            if FILTER_MODE == 1:
                flag = tl.load(flag_ptr + (pid_m * BLOCK_M // FLAG_ROWS) * stride_flag + k0 // FLAG_COLS)
            elif FILTER_MODE == 2:
                flag = tl.load(flag_ptr + (k0 // FLAG_ROWS) * stride_flag + pid_m * BLOCK_M // FLAG_COLS)
            else:
                flag = tl.load(flag_ptr + (k0 // FLAG_ROWS) * stride_flag + pid_n * BLOCK_N // FLAG_COLS)
            if flag != 0:
                a = tl.load(a_ptrs, mask=offs_k[None, :] < K - k0, other=0.0)
                b = tl.load(b_ptrs, mask=offs_k[:, None] < K - k0, other=0.0)
                acc = tl.dot(dot_operand(a), dot_operand(b), acc, input_precision=PRECISION)
            a_ptrs += BLOCK_K * stride_ak
            b_ptrs += BLOCK_K * stride_bk
    acc = acc * tl.load(scale_ptr)
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    # 64-bit tile base, 32-bit offsets inside the tile (fewer registers in the epilogue)
    tile = c_offset + (pid_m * BLOCK_M).to(tl.int64) * stride_cm + (pid_n * BLOCK_N).to(tl.int64) * stride_cn
    local = tl.arange(0, BLOCK_M)[:, None] * stride_cm + tl.arange(0, BLOCK_N)[None, :] * stride_cn
    c_tile = c_ptr + tile
    if EPILOGUE == 0:
        tl.store(c_tile + local, acc.to(c_ptr.dtype.element_ty), mask=mask)
    elif EPILOGUE == 1:
        if not FIRST:
            acc += tl.load(c_tile + local, mask=mask, other=0.0)
        tl.store(c_tile + local, acc, mask=mask)
    else:
        lo_tile = lo_ptr + tile
        if not FIRST:
            acc += tl.load(c_tile + local, mask=mask, other=0.0).to(tl.float32)
            acc += tl.load(lo_tile + local, mask=mask, other=0.0).to(tl.float32)
        hi = acc.to(c_ptr.dtype.element_ty)
        tl.store(c_tile + local, hi, mask=mask)
        if not LAST:
            tl.store(lo_tile + local, (acc - hi.to(tl.float32)).to(lo_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _scale_cast_kernel(src_ptr, scale_ptr, dst_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(src_ptr + offs, mask=keep, other=0.0) * tl.load(scale_ptr)
    tl.store(dst_ptr + offs, x.to(dst_ptr.dtype.element_ty), mask=keep)


# ----------------------------------------------------------------------------------------------
# launchers


class Problem(NamedTuple):
    n_tok: int
    D: int
    V: int  # vocabulary rows held here
    stride_ht: int
    stride_hd: int
    stride_wv: int
    stride_wd: int
    stride_label: int
    dtype: str


def _problem(hidden, weight, labels, bias, transpose_y: bool) -> Problem:
    if len(T.shape(hidden)) != 2:
        raise ValueError(f"hidden: expected a 2-D tensor [T, D], got shape {T.shape(hidden)}")
    n_tok, D = T.shape(hidden)
    if len(T.shape(weight)) != 2:
        raise ValueError(f"weight: expected a 2-D tensor, got shape {T.shape(weight)}")
    if transpose_y:
        V, wd = T.shape(weight)
        stride_wv, stride_wd = T.strides(weight)
    else:
        wd, V = T.shape(weight)
        stride_wd, stride_wv = T.strides(weight)
    if wd != D:
        layout = "[V, D]" if transpose_y else "[D, V]"
        raise ValueError(f"weight: expected {layout} with D={D}, got shape {T.shape(weight)}")
    dtype = T.dtype_name(hidden)
    if T.dtype_name(weight) != dtype:
        raise TypeError(f"weight: expected dtype {dtype} (as hidden), got {T.dtype_name(weight)}")
    T.check_same_shape("labels", labels, (n_tok,))
    if T.dtype_name(labels) not in ("int64", "int32"):
        raise TypeError(f"labels: expected int64 or int32, got {T.dtype_name(labels)}")
    if bias is not None:
        T.check_same_shape("bias", bias, (V,))
        T.check_contiguous("bias", bias)
    stride_ht, stride_hd = T.strides(hidden)
    return Problem(n_tok, D, V, stride_ht, stride_hd, stride_wv, stride_wd, T.strides(labels)[0], dtype)


def _meta(p: Problem, cfg: TileConfig, K: int) -> dict:
    """Compile-time arguments shared by the GEMM kernels for a reduction of length K."""
    return dict(PRECISION="ieee" if p.dtype == "float32" else "tf32",
                BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, GROUP_M=cfg.group_m,
                EVEN_K=K % cfg.block_k == 0, num_warps=cfg.num_warps, num_stages=cfg.num_stages)


def forward_splits(n_tok: int, V: int, dtype: str = "bfloat16", tiles: Tiles | None = None) -> int:
    """Vocabulary splits of the forward: at most MAX_SPLITS (the partials stay ``16 * MAX_SPLITS``
    bytes a token whatever V is), chosen so the last wave of programs is nearly full (estimated on
    NUM_SMS_GUESS multiprocessors)."""
    cfg = (tiles or default_tiles(dtype)).forward
    n_tblk = triton.cdiv(max(n_tok, 1), cfg.block_m)
    n_vtiles = triton.cdiv(max(V, 1), cfg.block_n)
    best, best_eff = 1, -1.0
    for per in range(n_vtiles, triton.cdiv(n_vtiles, MAX_SPLITS) - 1, -1):  # fewest splits first
        n_split = triton.cdiv(n_vtiles, per)
        waves = triton.cdiv(n_tblk * n_split, NUM_SMS_GUESS)
        eff = (n_tblk * n_vtiles) / (waves * NUM_SMS_GUESS * per)
        if eff > best_eff + 1e-3:
            best, best_eff = n_split, eff
    return best


def lse_forward(hidden, weight, labels, bias, partials, stats, *, transpose_y: bool = True,
                vocab_start: int = 0, softcap: float | None = None, need_sum: bool = False,
                tiles: Tiles | None = None) -> None:
    """Per-token statistics over this rank's vocabulary, without logits.

    partials: fp32 ``[4, n_split, T]`` workspace, ``n_split = forward_splits(T, V, dtype)``;
    stats: fp32 ``[3, T]`` output (lse, target logit (0 when the label is not held here), logit sum
    (0 unless ``need_sum``)). Labels are global ids; this rank holds ``[vocab_start, vocab_start+V)``.
    """
    p = _problem(hidden, weight, labels, bias, transpose_y)
    tiles = tiles or default_tiles(p.dtype)
    cfg = tiles.forward
    n_split = forward_splits(p.n_tok, p.V, p.dtype, tiles)
    T.check_same_shape("partials", partials, (4, n_split, p.n_tok))
    T.check_same_shape("stats", stats, (3, p.n_tok))
    for name, t in (("partials", partials), ("stats", stats)):
        T.check_contiguous(name, t)
        if T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected float32, got {T.dtype_name(t)}")
    if p.n_tok == 0:
        return
    if p.V == 0:
        raise ValueError("weight: this rank holds no vocabulary rows")
    n_tblk = triton.cdiv(p.n_tok, cfg.block_m)
    n_vtiles = triton.cdiv(p.V, cfg.block_n)
    per = triton.cdiv(n_vtiles, n_split)
    _lse_partials_kernel[(n_tblk * n_split,)](
        hidden, weight, bias if bias is not None else hidden, labels, partials,
        p.n_tok, p.V, p.D, vocab_start, n_tblk, n_split, per, n_vtiles,
        p.stride_ht, p.stride_hd, p.stride_wv, p.stride_wd, p.stride_label, float(softcap or 1.0),
        HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, NEED_SUM=need_sum, **_meta(p, cfg, p.D))
    block = 1024
    _combine_kernel[(triton.cdiv(p.n_tok, block),)](partials, stats, p.n_tok, n_split, BLOCK=block)


def token_loss(stats, labels, loss, flag, *, vocab_total: int, ignore_index: int = -100,
               label_smoothing: float = 0.0, z_loss: float = 0.0, row0: int = 0, n_tok: int | None = None) -> None:
    """loss ``[T]`` fp32 of tokens ``row0 .. row0 + n_tok`` from their (global) stats ``[3, >= n_tok]``
    (see ``lse_forward``). ``flag``: int64 ``[1]`` set to ``ignore_index`` by the caller; a label outside
    ``[0, vocab_total)`` is written there (and that token's loss is NaN)."""
    n_tok = T.shape(loss)[0] - row0 if n_tok is None else n_tok
    T.check_same_shape("flag", flag, (1,))
    if T.dtype_name(flag) != "int64":
        raise TypeError(f"flag: expected int64, got {T.dtype_name(flag)}")
    if len(T.shape(stats)) != 2 or T.shape(stats)[0] != 3 or T.shape(stats)[1] < n_tok:
        raise ValueError(f"stats: expected [3, >= {n_tok}], got {T.shape(stats)}")
    if row0 < 0 or row0 + n_tok > min(T.shape(loss)[0], T.shape(labels)[0]):
        raise ValueError(f"row0: tokens {row0}..{row0 + n_tok} past loss {T.shape(loss)} / labels {T.shape(labels)}")
    for name, t in (("stats", stats), ("loss", loss)):
        T.check_contiguous(name, t)
    if n_tok == 0:
        return
    block = 1024
    _token_loss_kernel[(triton.cdiv(n_tok, block),)](
        stats, labels, loss, flag, n_tok, row0, T.shape(stats)[1], vocab_total, ignore_index, T.strides(labels)[0],
        float(label_smoothing), float(z_loss), BLOCK=block)


class BackwardWorkspace(NamedTuple):
    """Shapes the caller allocates for ``lce_backward``: G ``[T, Vc]`` (input dtype), lo ``[T, D]``
    (input dtype; None for fp32), flags int8, dbias fp32 ``[V]`` (zero-filled, only with a bias);
    dbias_parts fp32 ``[token blocks, Vc]`` (only for a deterministic bias gradient)."""
    chunk: int
    g: tuple
    lo: tuple | None
    flags: tuple
    dbias: tuple
    dbias_parts: tuple


def backward_workspace(n_tok: int, D: int, V: int, dtype: str, chunk: int | None = None,
                       chunk_bytes: int = DEFAULT_CHUNK_BYTES, tiles: Tiles | None = None) -> BackwardWorkspace:
    """``Vc`` = ``chunk`` rounded to the G tile width, default about ``chunk_bytes`` of G."""
    cfg = (tiles or default_tiles(dtype)).grad
    if chunk is None:
        chunk = chunk_bytes // max(1, n_tok * T.itemsize(dtype))
    chunk = max(cfg.block_n, chunk // cfg.block_n * cfg.block_n)
    chunk = min(chunk, triton.cdiv(max(V, 1), cfg.block_n) * cfg.block_n)
    token_blocks = triton.cdiv(max(n_tok, 1), cfg.block_m)
    return BackwardWorkspace(
        chunk, (n_tok, chunk), None if dtype == "float32" else (n_tok, D),
        (token_blocks, chunk // cfg.block_n), (V,), (token_blocks, chunk))


def _filter_compatible(tiles: Tiles, transpose_y: bool) -> Tiles:
    """The dW / dh tiles must each sit inside one flag block of G; otherwise they take G's tiles."""
    g, mm = tiles.grad, tiles.matmul
    ok = g.block_m % mm.block_m == 0 and g.block_n % mm.block_k == 0 and g.block_m % mm.block_k == 0
    ok = ok and g.block_n % (mm.block_m if transpose_y else mm.block_n) == 0
    return tiles if ok else tiles._replace(matmul=g)


def lce_backward(hidden, weight, labels, bias, lse, coef_p, coef_y, scale, dh, dw, dbias,
                 g_work, lo_work, flags, dbias_acc, *, transpose_y: bool = True, vocab_start: int = 0,
                 vocab_total: int | None = None, softcap: float | None = None, label_smoothing: float = 0.0,
                 filter_eps: float | None = None, filter_dh: bool = True, filter_dw: bool = True,
                 tiles: Tiles | None = None, dbias_parts=None) -> None:
    """Gradients for this rank's vocabulary rows, written into dh ``[T, D]`` (a partial sum over the
    rows held here), dw (the weight's layout) and dbias ``[V]`` (or None).

    lse, coef_p, coef_y: fp32 ``[T]`` (global lse; ``coef_p = dloss (1 + 2 z lse) + dlse``,
    ``coef_y = dloss``, zero where a token carries no gradient); scale: fp32 ``[1]`` multiplying every
    gradient (so the coefficients can be normalised and G stays in fp16 range). Workspaces as
    ``backward_workspace`` says: g_work, lo_work (None for fp32), flags, dbias_acc (None without bias).
    With ``filter_eps``, ``filter_dh`` / ``filter_dw`` say which gradient GEMMs skip the filtered tiles.
    ``dbias_parts`` (fp32 contiguous ``ws.dbias_parts``, contents ignored; with a bias) makes the bias
    gradient deterministic: per-token-block column sums there, added in a fixed order, not atomics.
    """
    p = _problem(hidden, weight, labels, bias, transpose_y)
    tiles = tiles or default_tiles(p.dtype)
    vocab_total = p.V if vocab_total is None else vocab_total
    T.check_same_shape("dh", dh, (p.n_tok, p.D))
    T.check_contiguous("dh", dh)
    T.check_same_shape("dw", dw, T.shape(weight))
    for name, t in (("lse", lse), ("coef_p", coef_p), ("coef_y", coef_y)):
        T.check_same_shape(name, t, (p.n_tok,))
        T.check_contiguous(name, t)
    T.check_same_shape("scale", scale, (1,))
    chunk = T.shape(g_work)[1]
    ws = backward_workspace(p.n_tok, p.D, p.V, p.dtype, chunk=chunk, tiles=tiles)
    T.check_same_shape("g_work", g_work, ws.g)
    T.check_contiguous("g_work", g_work)
    if ws.lo is not None:
        T.check_same_shape("lo_work", lo_work, ws.lo)
        T.check_contiguous("lo_work", lo_work)
    T.check_same_shape("flags", flags, ws.flags)
    if bias is not None:
        T.check_same_shape("dbias_acc", dbias_acc, ws.dbias)
        T.check_same_shape("dbias", dbias, (p.V,))
    deterministic = dbias_parts is not None and bias is not None
    if deterministic:
        _check_buffer("dbias_parts", dbias_parts, ws.dbias_parts, "float32")
    filt = filter_eps is not None
    if filt:
        tiles = _filter_compatible(tiles, transpose_y)
    if p.n_tok == 0 or p.D == 0 or p.V == 0:
        return
    g_cfg, mm = tiles.grad, tiles.matmul
    stride_dwv, stride_dwd = T.strides(dw) if transpose_y else T.strides(dw)[::-1]
    stride_flag = T.strides(flags)[0]
    flag_blocks = dict(FLAG_ROWS=g_cfg.block_m, FLAG_COLS=g_cfg.block_n)
    for c0 in range(0, p.V, chunk):
        n = min(chunk, p.V - c0)
        grid = (triton.cdiv(p.n_tok, g_cfg.block_m) * triton.cdiv(n, g_cfg.block_n),)
        parts = dict(ld_parts=chunk, DETERMINISTIC=True) if deterministic else {}  # the default build as it was
        _grad_logits_kernel[grid](
            hidden, weight, bias if bias is not None else hidden, labels, lse, coef_p, coef_y,
            g_work, (dbias_parts if deterministic else dbias_acc) if bias is not None else lse, flags,
            p.n_tok, p.D, c0, n, vocab_start, vocab_total,
            p.stride_ht, p.stride_hd, p.stride_wv, p.stride_wd, p.stride_label, chunk, stride_flag,
            float(softcap or 1.0), float(label_smoothing), float(filter_eps or 0.0),
            HAS_BIAS=bias is not None, SOFTCAP=softcap is not None, FILTER=filt, **_meta(p, g_cfg, p.D), **parts)
        if deterministic:
            add_parts(dbias_parts, dbias_acc, T.shape(dbias_parts)[0], n, part_strides=(0, chunk), out_offset=c0)
        if transpose_y:  # dW[c0:c0+n, :] = G^T h  (rows of dW contiguous along D)
            _matmul(p, mm, g_work, hidden, dw, None, scale, flags, n, p.D, p.n_tok, 0, 0, c0 * stride_dwv,
                    (1, chunk), (p.stride_ht, p.stride_hd), (stride_dwv, stride_dwd), stride_flag,
                    epilogue=0, first=True, last=True, filter_mode=2 if filt and filter_dw else 0, **flag_blocks)
        else:  # dW^T[:, c0:c0+n] = h^T G  (dW is [D, V], contiguous along V)
            _matmul(p, mm, hidden, g_work, dw, None, scale, flags, p.D, n, p.n_tok, 0, 0, c0 * stride_dwv,
                    (p.stride_hd, p.stride_ht), (chunk, 1), (stride_dwd, stride_dwv), stride_flag,
                    epilogue=0, first=True, last=True, filter_mode=3 if filt and filter_dw else 0, **flag_blocks)
        # dh (+)= G W[c0:c0+n]: fp32 dh accumulates in place; 16-bit dh as hi + lo
        _matmul(p, mm, g_work, weight, dh, lo_work, scale, flags, p.n_tok, p.D, n, 0, c0 * p.stride_wv, 0,
                (chunk, 1), (p.stride_wv, p.stride_wd), T.strides(dh), stride_flag,
                epilogue=1 if ws.lo is None else 2, first=c0 == 0, last=c0 + chunk >= p.V,
                filter_mode=1 if filt and filter_dh else 0, **flag_blocks)
    if bias is not None:
        block = 1024
        _scale_cast_kernel[(triton.cdiv(p.V, block),)](dbias_acc, scale, dbias, p.V, BLOCK=block)


def _matmul(p: Problem, cfg: TileConfig, a, b, c, lo, scale, flags, M, N, K, a_offset, b_offset, c_offset,
            a_strides, b_strides, c_strides, stride_flag, *, epilogue, first, last, filter_mode, FLAG_ROWS,
            FLAG_COLS):
    grid = (triton.cdiv(M, cfg.block_m) * triton.cdiv(N, cfg.block_n),)
    _matmul_kernel[grid](
        a, b, c, lo if lo is not None else c, scale, flags, M, N, K, a_offset, b_offset, c_offset,
        a_strides[0], a_strides[1], b_strides[0], b_strides[1], c_strides[0], c_strides[1], stride_flag,
        FLAG_ROWS=FLAG_ROWS, FLAG_COLS=FLAG_COLS, EPILOGUE=epilogue, FIRST=first, LAST=last,
        FILTER_MODE=filter_mode, **_meta(p, cfg, K))


# ----------------------------------------------------------------------------------------------
# chunked paths: logits chunks come from an outside GEMM (cuBLASLt on the GPU, injected by the
# caller as ``gemm``); the softmax / cross-entropy work on each chunk runs here.
#
# lean     4 GEMMs, workspace flat in T and V (under 0.1 GiB, see linear_cross_entropy_tuning.py):
#          tokens in blocks of Tb, vocabulary in chunks of Vc, each stage with its own plan.
#          forward: fp32 logits [Tb, Vc] -> online (max, sum-exp, target, sum) per token;
#          backward: the fp32 logits again -> G written over them in the input dtype (16-bit rows at
#          the fp32 rows' starts) -> dW[chunk] (+)= G^T h_blk (over T / Tb token blocks, in dW's dtype),
#          dh_acc (fp32 [Tb, D]) (+)= G W[chunk] over the chunks (fp32 inputs: dh accumulated in place).
#          The logits stay fp32 because a gradient from logits rounded to 16 bits carries the plain
#          16-bit composition's error, above DESIGN's 1e-2 where dh cancels (benchmarks/NOTES.md).
# bounded  3 GEMMs, gradients in the forward pass: tokens in blocks whose [Tb, V] logits (input dtype)
#          fit the caller's bound; per block the logits once -> stats -> loss -> G in place ->
#          dh[blk] = G W (complete) and dW (+)= G^T h_blk (over T / Tb blocks, in dW's dtype: fp32
#          when the caller hands an fp32 buffer).
# A gemm is called as gemm(a, b, d, m=, n=, k=, trans_a=, trans_b=, alpha=, beta=, a_offset=,
# b_offset=, d_offset=, lda=, ldb=, ldd=, heuristic=): row-major D[m,n] = alpha op(A) op(B) + beta D
# (kernels/cuda/gemm.py), operands as tensors plus element offsets and row strides.


class ChunkPlan(NamedTuple):
    tokens: int  # token block Tb
    vocab: int  # vocabulary chunk Vc (V: the bounded path's whole vocabulary)
    ld: int  # row stride of the logits buffer (Vc or V rounded up to 8 elements: aligned GEMM rows)
    workspace: int = tuning.GEMM_WORKSPACE[1]  # bytes of cuBLASLt workspace to hand the GEMMs
    heuristic: tuple = (0, 0, 0)  # cuBLASLt heuristic index of the logits, dh and dW GEMMs
    g_dtype: str | None = None  # 16-bit G written over fp32 logits (lean backward); None: in the logits' dtype


def _round8(n: int) -> int:
    return -(-n // 8) * 8


def _balanced(n: int, most: int) -> int:
    """The block size of the fewest blocks of at most ``most`` covering ``n``, balanced in size."""
    n, most = max(n, 1), max(most, 1)
    return -(-n // -(-n // most))


def lean_plan(n_tok: int, V: int, D: int, dtype: str, *, backward: bool, tokens: int | None = None,
              vocab: int | None = None) -> ChunkPlan:
    """The lean path's plan of its forward or backward stage (sizes in linear_cross_entropy_tuning.py);
    ``tokens`` / ``vocab`` override the block and chunk sizes."""
    narrow = backward and dtype != "float32"
    most = tuning.LEAN_TOKENS
    if narrow:  # the fp32 dh accumulator [Tb, D]
        most = min(most, tuning.LEAN_DH_ACC_BYTES // (4 * max(D, 1)))
    tb = min(tokens or _balanced(n_tok, most), max(n_tok, 1))
    nbytes = tuning.LEAN_NARROW_LOGITS_BYTES if narrow else tuning.LEAN_LOGITS_BYTES
    vc = vocab or max(256, nbytes // (4 * tb) // 256 * 256)
    vc = max(1, min(vc, max(V, 1)))
    return ChunkPlan(tb, vc, _round8(vc), tuning.GEMM_WORKSPACE[0 if narrow else 1], tuning.GEMM_HEURISTIC["lean"],
                     dtype if narrow else None)


def lean_workspace(plan: ChunkPlan, D: int) -> dict:
    """Shapes and dtypes the caller allocates for a lean stage: the fp32 logits block, and where G is
    written over it in 16 bits (a 16-bit backward) the fp32 dh accumulator."""
    out = {"logits": ((plan.tokens, plan.ld), "float32")}
    if plan.g_dtype is not None:
        out["dh_acc"] = ((plan.tokens, D), "float32")
    return out


def bounded_tokens(V: int, dtype: str, max_bytes: int) -> int:
    """How many tokens' [., V] logits (``dtype``) fit ``max_bytes`` beside the least GEMM workspace."""
    return (int(max_bytes) - tuning.GEMM_WORKSPACE[0]) // (_round8(V) * T.itemsize(dtype))


def bounded_plan(n_tok: int, V: int, dtype: str, max_bytes: int) -> ChunkPlan:
    """The fewest token blocks whose [Tb, V] logits (``dtype``) and the GEMM workspace fit ``max_bytes``,
    balanced in size (each block reads and writes the whole dW, so few large blocks beat many small
    ones); the workspace takes what the logits leave, between tuning.GEMM_WORKSPACE's bounds."""
    row = _round8(V) * T.itemsize(dtype)
    least, most_ws = tuning.GEMM_WORKSPACE
    most = bounded_tokens(V, dtype, max_bytes)
    if most < 1:
        raise ValueError(f"max_workspace_gib: {max_bytes / 2**30:.4g} GiB holds no token's logits "
                         f"({row} bytes a token at V={V}, plus {least} bytes of GEMM workspace)")
    blocks = -(-max(n_tok, 1) // most)
    tokens = -(-max(n_tok, 1) // blocks)
    workspace = min(most_ws, (int(max_bytes) - tokens * row) // 2**20 * 2**20)
    return ChunkPlan(tokens, V, _round8(V), max(workspace, least), tuning.GEMM_HEURISTIC["bounded"])


@triton.jit
def _chunk_stats_kernel(x_ptr, ld_x, bias_ptr, labels_ptr, state_ptr, stats_ptr,
                        n_rows, n_cols, row0, col0, vocab_start, state_plane, stats_plane, stats_row0,
                        stride_label, softcap,
                        FIRST: tl.constexpr, LAST: tl.constexpr, HAS_BIAS: tl.constexpr, SOFTCAP: tl.constexpr,
                        NEED_SUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Folds logits x[r, j] (token row0 + r, vocabulary row col0 + j of this rank) into the running
    (max, sum-exp, target logit, logit sum) ``state [4, state_plane]`` (token-indexed); on the LAST
    chunk writes ``stats [3, stats_plane]`` (lse, target, sum) at column row0 + r - stats_row0."""
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep_r = offs_r < n_rows
    rows = (row0 + offs_r).to(tl.int64)
    local = tl.load(labels_ptr + rows * stride_label, mask=keep_r, other=-1).to(tl.int64) - vocab_start - col0
    if FIRST:
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        tgt = tl.zeros([BLOCK_M], tl.float32)
        total = tl.zeros([BLOCK_M], tl.float32)
    else:
        m_i = tl.load(state_ptr + rows, mask=keep_r, other=0.0)
        l_i = tl.load(state_ptr + state_plane + rows, mask=keep_r, other=0.0)
        tgt = tl.load(state_ptr + 2 * state_plane + rows, mask=keep_r, other=0.0)
        total = tl.load(state_ptr + 3 * state_plane + rows, mask=keep_r, other=0.0)
    x_rows = x_ptr + offs_r.to(tl.int64)[:, None] * ld_x
    for c in range(0, n_cols, BLOCK_N):
        cols = c + tl.arange(0, BLOCK_N)
        inside = keep_r[:, None] & (cols < n_cols)[None, :]
        s = tl.load(x_rows + cols[None, :], mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(bias_ptr + col0 + cols, mask=cols < n_cols, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        s_in = tl.where(inside, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s_in, 1))
        m_safe = tl.where(keep_r, m_new, 0.0)  # rows past the block: no inf - inf
        l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(s_in - m_safe[:, None]), 1)
        m_i = m_new
        tgt += tl.sum(tl.where(inside & (cols[None, :] == local[:, None]), s, 0.0), 1)
        if NEED_SUM:
            total += tl.sum(tl.where(inside, s, 0.0), 1)
    if LAST:
        out = stats_ptr + (rows - stats_row0)
        tl.store(out, m_i + tl.log(l_i), mask=keep_r)
        tl.store(out + stats_plane, tgt, mask=keep_r)
        tl.store(out + 2 * stats_plane, total, mask=keep_r)
    else:
        tl.store(state_ptr + rows, m_i, mask=keep_r)
        tl.store(state_ptr + state_plane + rows, l_i, mask=keep_r)
        tl.store(state_ptr + 2 * state_plane + rows, tgt, mask=keep_r)
        tl.store(state_ptr + 3 * state_plane + rows, total, mask=keep_r)


@triton.jit
def _chunk_grad_kernel(x_ptr, ld_x, bias_ptr, labels_ptr, lse_ptr, coef_p_ptr, coef_y_ptr, dbias_ptr,
                       n_rows, n_cols, row0, col0, vocab_start, vocab_total, lse_row0, stride_label, ignore_index,
                       softcap, label_smoothing, z_loss,
                       HAS_BIAS: tl.constexpr, DBIAS: tl.constexpr, SOFTCAP: tl.constexpr, COEFS: tl.constexpr,
                       NARROW: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ld_parts=0,
                       DETERMINISTIC: tl.constexpr = False):
    """G = f'(a) (coef_p softmax - coef_y ((1 - eps) onehot + eps / V_total)) of a logits chunk x, written
    over it: in x's dtype (each element read, then written, by the same program), or NARROW (1:
    bfloat16, 2: float16) over fp32 logits, row r of G starting where row r of x does (row stride
    2 ld_x 16-bit elements), each program walking its rows' columns in order so that what it writes
    lies behind what it has read (a barrier between reading and writing a step).
    COEFS: coef_p / coef_y are token-indexed arrays; else coef_y = [label != ignore_index] and
    coef_p = coef_y (1 + 2 z lse). dbias (fp32, vocabulary-indexed) += the column sums of G; DETERMINISTIC:
    dbias_ptr is the workspace [row blocks, ld_parts] of this chunk's column sums, one row a program."""
    offs_r = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    keep_r = offs_r < n_rows
    rows = (row0 + offs_r).to(tl.int64)
    label = tl.load(labels_ptr + rows * stride_label, mask=keep_r, other=ignore_index).to(tl.int64)
    lse = tl.load(lse_ptr + (rows - lse_row0), mask=keep_r, other=0.0)
    if COEFS:
        coef_p = tl.load(coef_p_ptr + rows, mask=keep_r, other=0.0)
        coef_y = tl.load(coef_y_ptr + rows, mask=keep_r, other=0.0)
    else:
        coef_y = tl.where(label != ignore_index, 1.0, 0.0)
        coef_p = coef_y * (1.0 + 2.0 * z_loss * lse)
    local = label - vocab_start - col0
    x_rows = x_ptr + offs_r.to(tl.int64)[:, None] * ld_x
    if NARROW == 1:
        g_rows = x_ptr.to(tl.pointer_type(tl.bfloat16)) + offs_r.to(tl.int64)[:, None] * (2 * ld_x)
    elif NARROW == 2:
        g_rows = x_ptr.to(tl.pointer_type(tl.float16)) + offs_r.to(tl.int64)[:, None] * (2 * ld_x)
    else:
        g_rows = x_rows
    for c in range(tl.program_id(1) * BLOCK_N, n_cols, tl.num_programs(1) * BLOCK_N):
        offs_c = c + tl.arange(0, BLOCK_N)
        keep_c = offs_c < n_cols
        inside = keep_r[:, None] & keep_c[None, :]
        s = tl.load(x_rows + offs_c[None, :], mask=inside, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(bias_ptr + col0 + offs_c, mask=keep_c, other=0.0).to(tl.float32)[None, :]
        if SOFTCAP:
            s = softcap * _tanh(s / softcap)
        target = tl.where(offs_c[None, :] == local[:, None], 1.0 - label_smoothing, 0.0) + label_smoothing / vocab_total
        grad = coef_p[:, None] * tl.exp(s - lse[:, None]) - coef_y[:, None] * target
        if SOFTCAP:
            capped = s / softcap
            grad = grad * (1.0 - capped * capped)
        grad = tl.where(inside, grad, 0.0)
        if NARROW:
            tl.debug_barrier()  # every thread's reads of this step before any write over them
        tl.store(g_rows + offs_c[None, :], grad.to(g_rows.dtype.element_ty), mask=inside)
        if DBIAS and DETERMINISTIC:
            tl.store(dbias_ptr + tl.program_id(0) * ld_parts + offs_c, tl.sum(grad, 0), mask=keep_c)
        elif DBIAS:
            tl.atomic_add(dbias_ptr + col0 + offs_c, tl.sum(grad, 0), mask=keep_c)


@triton.jit
def _cast_scale_kernel(src_ptr, dst_ptr, n, dst_offset, scale, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    keep = offs < n
    x = tl.load(src_ptr + offs, mask=keep, other=0.0) * scale
    tl.store(dst_ptr + dst_offset + offs, x.to(dst_ptr.dtype.element_ty), mask=keep)


def _cast_scale(src, dst, n: int, dst_offset: int = 0, scale: float = 1.0) -> None:
    if n:
        block = 1024
        _cast_scale_kernel[(triton.cdiv(n, block),)](src, dst, n, dst_offset, float(scale), BLOCK=block)


def _unit_inner(p: Problem, transpose_y: bool) -> None:
    if p.stride_hd != 1 and p.D > 1:
        raise ValueError(f"hidden: the chunked paths take a contiguous last axis, got stride {p.stride_hd}")
    inner = p.stride_wd if transpose_y else p.stride_wv
    if inner != 1 and p.D > 1 and p.V > 1:
        raise ValueError("weight: the chunked paths take a weight with a contiguous last axis")


def _logits_gemm(gemm, p: Problem, hidden, weight, out, t0, tb, c0, vc, ld, transpose_y, heuristic=0) -> None:
    """out[:tb, :vc] = h[t0 : t0 + tb] @ W[c0 : c0 + vc]^T (W in either layout)."""
    if transpose_y:  # W [V, D]: rows c0.. used transposed
        wb = dict(trans_b=True, b_offset=c0 * p.stride_wv, ldb=p.stride_wv)
    else:  # W [D, V]: columns c0..
        wb = dict(trans_b=False, b_offset=c0, ldb=p.stride_wd)
    gemm(hidden, weight, out, m=tb, n=vc, k=p.D, trans_a=False, alpha=1.0, beta=0.0, a_offset=t0 * p.stride_ht,
         lda=p.stride_ht, d_offset=0, ldd=ld, heuristic=heuristic, **wb)


def _dh_gemm(gemm, p: Problem, g, ld_g, weight, d, d_offset, ldd, tb, c0, vc, alpha, beta, transpose_y,
             heuristic=0, g_dtype=None) -> None:
    """d[tb, D] (+)= alpha G[:tb, :vc] @ W[c0 : c0 + vc]."""
    if transpose_y:
        wb = dict(trans_b=False, b_offset=c0 * p.stride_wv, ldb=p.stride_wv)
    else:
        wb = dict(trans_b=True, b_offset=c0, ldb=p.stride_wd)
    gemm(g, weight, d, m=tb, n=p.D, k=vc, trans_a=False, alpha=alpha, beta=beta, a_offset=0, lda=ld_g,
         d_offset=d_offset, ldd=ldd, heuristic=heuristic, a_dtype=g_dtype, **wb)


def _dw_gemm(gemm, p: Problem, g, ld_g, hidden, dw, t0, tb, c0, vc, alpha, beta, transpose_y, heuristic=0,
             g_dtype=None) -> None:
    """dW[c0 : c0 + vc] (+)= alpha G[:tb, :vc]^T h[t0 : t0 + tb], in dW's layout."""
    st = T.strides(dw)
    if transpose_y:  # dW [V, D]
        gemm(g, hidden, dw, m=vc, n=p.D, k=tb, trans_a=True, trans_b=False, alpha=alpha, beta=beta, a_offset=0,
             lda=ld_g, b_offset=t0 * p.stride_ht, ldb=p.stride_ht, d_offset=c0 * st[0], ldd=st[0],
             heuristic=heuristic, a_dtype=g_dtype)
    else:  # dW [D, V]: dW[:, c0..] = h^T G
        gemm(hidden, g, dw, m=p.D, n=vc, k=tb, trans_a=True, trans_b=False, alpha=alpha, beta=beta,
             a_offset=t0 * p.stride_ht, lda=p.stride_ht, b_offset=0, ldb=ld_g, d_offset=c0, ldd=st[0],
             heuristic=heuristic, b_dtype=g_dtype)


def _check_buffer(name, t, shape, dtype) -> None:
    T.check_same_shape(name, t, shape)
    T.check_contiguous(name, t)
    if T.dtype_name(t) != dtype:
        raise TypeError(f"{name}: expected {dtype}, got {T.dtype_name(t)}")


def _token_blocks(p, tokens: int):
    """(first token, tokens) of each block of at most ``tokens``; none for 0 tokens. A forward over
    no vocabulary rows is an error (its stats would be empty)."""
    if p.n_tok == 0:
        return
    if p.V == 0:
        raise ValueError("weight: this rank holds no vocabulary rows")
    for t0 in range(0, p.n_tok, tokens):
        yield t0, min(tokens, p.n_tok - t0)


def _chunk_stats(logits, ld, bias, labels, state, stats, tb, vc, t0, c0, p: Problem, vocab_start, state_plane,
                 stats_row0, softcap, first, last, need_sum) -> None:
    bm, bn, warps = tuning.STATS_TILE
    _chunk_stats_kernel[(triton.cdiv(tb, bm),)](
        logits, ld, bias if bias is not None else logits, labels, state, stats,
        tb, vc, t0, c0, vocab_start, state_plane, state_plane, stats_row0, p.stride_label, float(softcap or 1.0),
        FIRST=first, LAST=last, HAS_BIAS=bias is not None, SOFTCAP=softcap is not None,
        NEED_SUM=need_sum, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps)


def lean_forward(gemm, hidden, weight, labels, bias, logits, state, stats, *, plan: ChunkPlan,
                 transpose_y: bool = True, vocab_start: int = 0, softcap: float | None = None,
                 need_sum: bool = False) -> None:
    """Per-token stats ``[3, T]`` over this rank's vocabulary (as ``lse_forward``), from fp32 logits
    chunks ``logits [Tb, ld]``; ``state``: fp32 ``[4, T]`` workspace."""
    p = _problem(hidden, weight, labels, bias, transpose_y)
    _unit_inner(p, transpose_y)
    _check_buffer("logits", logits, (plan.tokens, plan.ld), "float32")
    _check_buffer("state", state, (4, p.n_tok), "float32")
    _check_buffer("stats", stats, (3, p.n_tok), "float32")
    for t0, tb in _token_blocks(p, plan.tokens):
        for c0 in range(0, p.V, plan.vocab):
            vc = min(plan.vocab, p.V - c0)
            _logits_gemm(gemm, p, hidden, weight, logits, t0, tb, c0, vc, plan.ld, transpose_y, plan.heuristic[0])
            _chunk_stats(logits, plan.ld, bias, labels, state, stats, tb, vc, t0, c0, p, vocab_start, p.n_tok, 0,
                         softcap, c0 == 0, c0 + plan.vocab >= p.V, need_sum)


_NARROW = {"bfloat16": 1, "float16": 2}


def _grad_chunk(x, ld_x, bias, labels, lse, coef_p, coef_y, dbias_acc, tb, vc, t0, c0, lse_row0, p,
                vocab_start, vocab_total, ignore_index, softcap, label_smoothing, z_loss, coefs,
                dbias_parts=None, g_dtype=None) -> None:
    """G of a logits chunk ``x [tb, ld_x]``, written over it in x's dtype or in ``g_dtype`` (16-bit, over
    fp32 logits: row stride 2 ld_x)."""
    narrow = _NARROW[g_dtype] if g_dtype not in (None, T.dtype_name(x)) else 0
    bm, bn, warps = tuning.NARROW_GRAD_TILE if narrow else tuning.GRAD_TILE
    deterministic = dbias_parts is not None and dbias_acc is not None
    parts = dict(ld_parts=T.shape(dbias_parts)[1], DETERMINISTIC=True) if deterministic else {}
    _chunk_grad_kernel[(triton.cdiv(tb, bm), 1 if narrow else triton.cdiv(vc, bn))](
        x, ld_x, bias if bias is not None else x, labels, lse,
        coef_p if coefs else lse, coef_y if coefs else lse,
        (dbias_parts if deterministic else dbias_acc) if dbias_acc is not None else lse,
        tb, vc, t0, c0, vocab_start, vocab_total, lse_row0, p.stride_label, ignore_index,
        float(softcap or 1.0), float(label_smoothing), float(z_loss),
        HAS_BIAS=bias is not None, DBIAS=dbias_acc is not None, SOFTCAP=softcap is not None, COEFS=coefs,
        NARROW=narrow, BLOCK_M=bm, BLOCK_N=bn, num_warps=warps, **parts)
    if deterministic:
        add_parts(dbias_parts, dbias_acc, triton.cdiv(tb, bm), vc, part_strides=(0, T.shape(dbias_parts)[1]),
                  out_offset=c0)


def chunk_dbias_parts_shape(plan: ChunkPlan) -> tuple:
    """The fp32 workspace of a deterministic bias gradient on the chunked paths (``dbias_parts`` of
    ``lean_backward`` / ``bounded_forward``): one row of column sums per row block of a chunk."""
    rows = (tuning.NARROW_GRAD_TILE if plan.g_dtype is not None else tuning.GRAD_TILE)[0]
    return (triton.cdiv(plan.tokens, rows), plan.vocab)


def lean_backward(gemm, hidden, weight, labels, bias, lse, coef_p, coef_y, scale: float, dh, dw, dbias,
                  logits, dh_acc, dbias_acc, *, plan: ChunkPlan, transpose_y: bool = True, vocab_start: int = 0,
                  vocab_total: int | None = None, softcap: float | None = None, label_smoothing: float = 0.0,
                  dbias_parts=None) -> None:
    """Gradients of this rank's rows into dh ``[T, D]`` (partial sum over the rows held here), dw (the
    weight's layout) and dbias ``[V]``; any of them None when not wanted. lse, coef_p, coef_y as for
    ``lce_backward``; ``scale`` (a host float) multiplies every gradient in the GEMMs. Workspaces as
    ``lean_workspace`` says for a backward ``lean_plan``: fp32 logits (G written over them in the input
    dtype), ``dh_acc`` (None for fp32, where dh accumulates in place); ``dbias_acc`` fp32 ``[V]`` zeroed;
    ``dbias_parts`` (``chunk_dbias_parts_shape``): a deterministic bias gradient (no atomics)."""
    p = _problem(hidden, weight, labels, bias, transpose_y)
    _unit_inner(p, transpose_y)
    vocab_total = p.V if vocab_total is None else vocab_total
    narrow = p.dtype != "float32"
    if plan.g_dtype != (p.dtype if narrow else None):
        raise ValueError(f"plan: a backward lean_plan for {p.dtype} inputs writes G in "
                         f"{p.dtype if narrow else 'the logits dtype'}, got g_dtype={plan.g_dtype}")
    _check_buffer("logits", logits, (plan.tokens, plan.ld), "float32")
    if narrow and dh is not None:
        _check_buffer("dh_acc", dh_acc, (plan.tokens, p.D), "float32")
    for name, t in (("lse", lse), ("coef_p", coef_p), ("coef_y", coef_y)):
        _check_buffer(name, t, (p.n_tok,), "float32")
    if dh is not None:
        _check_buffer("dh", dh, (p.n_tok, p.D), p.dtype)
    if dw is not None:
        T.check_same_shape("dw", dw, T.shape(weight))
        T.check_contiguous("dw", dw)
    if dbias is not None:
        _check_buffer("dbias_acc", dbias_acc, (p.V,), "float32")
        if dbias_parts is not None:
            _check_buffer("dbias_parts", dbias_parts, chunk_dbias_parts_shape(plan), "float32")
    if p.n_tok == 0 or p.V == 0 or p.D == 0:
        return
    h_logits, h_dh, h_dw = plan.heuristic
    ld_g = 2 * plan.ld if narrow else plan.ld  # G's row stride in its own elements
    for t0 in range(0, p.n_tok, plan.tokens):
        tb = min(plan.tokens, p.n_tok - t0)
        for c0 in range(0, p.V, plan.vocab):
            vc = min(plan.vocab, p.V - c0)
            _logits_gemm(gemm, p, hidden, weight, logits, t0, tb, c0, vc, plan.ld, transpose_y, h_logits)
            _grad_chunk(logits, plan.ld, bias, labels, lse, coef_p, coef_y,
                        dbias_acc if dbias is not None else None, tb, vc, t0, c0, 0, p, vocab_start, vocab_total, 0,
                        softcap, label_smoothing, 0.0, True, dbias_parts, plan.g_dtype)
            if dw is not None:
                _dw_gemm(gemm, p, logits, ld_g, hidden, dw, t0, tb, c0, vc, scale, 0.0 if t0 == 0 else 1.0,
                         transpose_y, h_dw, plan.g_dtype)
            if dh is not None:  # into the fp32 accumulator, or fp32 dh itself
                out, offset = (dh_acc, 0) if narrow else (dh, t0 * p.D)
                _dh_gemm(gemm, p, logits, ld_g, weight, out, offset, p.D, tb, c0, vc, scale, 0.0 if c0 == 0 else 1.0,
                         transpose_y, h_dh, plan.g_dtype)
        if dh is not None and narrow:
            _cast_scale(dh_acc, dh, tb * p.D, t0 * p.D)
    if dbias is not None:
        _cast_scale(dbias_acc, dbias, p.V, 0, scale)


def bounded_forward(gemm, hidden, weight, labels, bias, logits, stats, loss, flag, dh, dw, dbias_acc, *,
                    plan: ChunkPlan, alpha: float, accumulate_dw: bool = False, combine=None,
                    transpose_y: bool = True, vocab_start: int = 0, vocab_total: int | None = None,
                    ignore_index: int = -100, softcap: float | None = None, label_smoothing: float = 0.0,
                    z_loss: float = 0.0, dbias_parts=None) -> None:
    """Loss and gradients in one pass over token blocks (3 GEMMs): per-token loss ``[T]`` (flag as
    ``token_loss``), dh ``[T, D]`` (partial over the rows held here), dW (the weight's layout, input
    dtype or fp32; added to its contents when ``accumulate_dw``), dbias_acc (fp32 ``[V]``, zeroed: the
    unscaled bias gradient); each gradient for a loss of ``alpha * sum`` of the per-token losses.
    ``logits [Tb, ld]`` and ``stats [3, Tb]`` (fp32) are the per-block workspaces; ``combine(stats)``
    returns the global stats of a block (vocabulary parallel) and may return ``stats`` itself.
    ``dbias_parts`` (``chunk_dbias_parts_shape``): a deterministic bias gradient (no atomics)."""
    p = _problem(hidden, weight, labels, bias, transpose_y)
    _unit_inner(p, transpose_y)
    vocab_total = p.V if vocab_total is None else vocab_total
    _check_buffer("logits", logits, (plan.tokens, plan.ld), p.dtype)
    _check_buffer("stats", stats, (3, plan.tokens), "float32")
    _check_buffer("loss", loss, (p.n_tok,), "float32")
    if dh is not None:
        _check_buffer("dh", dh, (p.n_tok, p.D), p.dtype)
    if dw is not None:
        T.check_same_shape("dw", dw, T.shape(weight))
        T.check_contiguous("dw", dw)
        if T.dtype_name(dw) not in (p.dtype, "float32"):
            raise TypeError(f"dw: expected {p.dtype} or float32, got {T.dtype_name(dw)}")
    if bias is not None:
        _check_buffer("dbias_acc", dbias_acc, (p.V,), "float32")
        if dbias_parts is not None:
            _check_buffer("dbias_parts", dbias_parts, chunk_dbias_parts_shape(plan), "float32")
    h_logits, h_dh, h_dw = plan.heuristic
    for t0, tb in _token_blocks(p, plan.tokens):
        _logits_gemm(gemm, p, hidden, weight, logits, t0, tb, 0, p.V, plan.ld, transpose_y, h_logits)
        _chunk_stats(logits, plan.ld, bias, labels, stats, stats, tb, p.V, t0, 0, p, vocab_start, plan.tokens, t0,
                     softcap, True, True, label_smoothing > 0)
        glob = stats if combine is None else combine(stats)
        token_loss(glob, labels, loss, flag, vocab_total=vocab_total, ignore_index=ignore_index,
                   label_smoothing=label_smoothing, z_loss=z_loss, row0=t0, n_tok=tb)
        _grad_chunk(logits, plan.ld, bias, labels, glob, None, None,
                    dbias_acc if bias is not None else None, tb, p.V, t0, 0, t0,
                    p, vocab_start, vocab_total, ignore_index, softcap, label_smoothing, z_loss, False, dbias_parts)
        if dh is not None:
            _dh_gemm(gemm, p, logits, plan.ld, weight, dh, t0 * p.D, p.D, tb, 0, p.V, alpha, 0.0, transpose_y, h_dh)
        if dw is not None:
            beta = 1.0 if (t0 > 0 or accumulate_dw) else 0.0
            _dw_gemm(gemm, p, logits, plan.ld, hidden, dw, t0, tb, 0, p.V, alpha, beta, transpose_y, h_dw)


def flops(n_tok: int, D: int, V: int) -> dict:
    """Matrix FLOPs: the forward's logits; the backward's logits, dW and dh; the 3-GEMM floor."""
    gemm = 2 * n_tok * D * V
    return {"fwd": gemm, "bwd": 3 * gemm, "fwdbwd": 4 * gemm, "floor_fwdbwd": 3 * gemm}


def compile_cases():
    """The canonical bf16 case (plain, and with bias, softcap, smoothing and the filter) and a small
    fp32 case in the [D, V] layout; the chunked paths' kernels (their GEMMs are cuBLASLt's, not
    compiled here) at an odd vocabulary, with and without the options; the deterministic bias
    gradient (bf16 with the options) of the triton and lean backwards (the bounded path's gradient
    kernel is the lean one's)."""
    cases = [("bfloat16", 8192, 4096, 128256, True, False), ("bfloat16", 8192, 4096, 128256, True, True),
             ("float32", 37, 48, 300, False, True)]
    for dtype, n_tok, D, V, transpose_y, options in cases:
        spec = T.SpecTensor
        hidden, labels = spec((n_tok, D), dtype), spec((n_tok,), "int64")
        weight = spec((V, D) if transpose_y else (D, V), dtype)
        bias = spec((V,), dtype) if options else None
        partials = spec((4, forward_splits(n_tok, V, dtype), n_tok), "float32")
        stats, vec, scale = spec((3, n_tok), "float32"), spec((n_tok,), "float32"), spec((1,), "float32")
        ws = backward_workspace(n_tok, D, V, dtype)
        work = (spec(ws.g, dtype), spec(ws.lo, dtype) if ws.lo else None, spec(ws.flags, "int8"),
                spec(ws.dbias, "float32") if options else None)
        grads = (spec((n_tok, D), dtype), spec(weight.shape, dtype), spec((V,), dtype) if options else None)
        opts = dict(transpose_y=transpose_y, softcap=30.0 if options else None)
        tag = f"{dtype},T={n_tok},D={D},V={V},{'VD' if transpose_y else 'DV'}{',options' if options else ''}"
        yield f"lce_forward[{tag}]", lambda a=(hidden, weight, labels, bias, partials, stats), o=opts, \
            ns=options: lse_forward(*a, need_sum=ns, **o)
        flag = spec((1,), "int64")
        yield f"lce_token_loss[{tag}]", lambda a=(stats, labels, vec, flag), V=V: token_loss(
            *a, vocab_total=V, label_smoothing=0.1)
        yield f"lce_backward[{tag}]", lambda a=(hidden, weight, labels, bias, vec, vec, vec, scale) + grads + work, \
            o=opts, f=options, d=dtype: lce_backward(*a, label_smoothing=0.1 if f else 0.0,
                                                     filter_eps=AUTO_FILTER_EPS[d] if f else None, **o)
        if options and dtype == "bfloat16":
            yield f"lce_backward[{tag},deterministic]", \
                lambda a=(hidden, weight, labels, bias, vec, vec, vec, scale) + grads + work, o=opts, \
                parts=spec(ws.dbias_parts, "float32"): lce_backward(*a, label_smoothing=0.1, dbias_parts=parts, **o)
    no_gemm = lambda *args, **kwargs: None  # noqa: E731
    for dtype, options in (("bfloat16", False), ("bfloat16", True), ("float32", True)):
        spec = T.SpecTensor
        n_tok, D, V = 4096, 4096, 8229
        hidden, labels, weight = spec((n_tok, D), dtype), spec((n_tok,), "int64"), spec((V, D), dtype)
        bias = spec((V,), dtype) if options else None
        vec, stats, state = spec((n_tok,), "float32"), spec((3, n_tok), "float32"), spec((4, n_tok), "float32")
        plan = lean_plan(n_tok, V, D, dtype, backward=False)
        bwd = lean_plan(n_tok, V, D, dtype, backward=True)
        logits = spec(*lean_workspace(plan, D)["logits"])
        ws = {k: spec(*v) for k, v in lean_workspace(bwd, D).items()}
        opts = dict(plan=bwd, softcap=30.0 if options else None)
        tag = f"{dtype},T={n_tok},D={D},V={V}{',options' if options else ''}"
        yield f"lce_lean_forward[{tag}]", lambda a=(hidden, weight, labels, bias, logits, state, stats), \
            o=dict(opts, plan=plan), ns=options: lean_forward(no_gemm, *a, need_sum=ns, **o)
        grad_args = (hidden, weight, labels, bias, vec, vec, vec, 0.5, spec((n_tok, D), dtype), spec((V, D), dtype),
                     bias, ws["logits"], ws.get("dh_acc"), spec((V,), "float32"))
        yield f"lce_lean_backward[{tag}]", lambda a=grad_args, o=opts, f=options: lean_backward(
            no_gemm, *a, label_smoothing=0.1 if f else 0.0, **o)
        if options and dtype == "bfloat16":
            yield f"lce_lean_backward[{tag},deterministic]", lambda a=grad_args, o=opts, \
                parts=spec(chunk_dbias_parts_shape(bwd), "float32"): lean_backward(no_gemm, *a, dbias_parts=parts, **o)
        bplan = bounded_plan(n_tok, V, dtype, 2**26)
        yield f"lce_bounded_forward[{tag}]", lambda a=(hidden, weight, labels, bias,
                                                       spec((bplan.tokens, bplan.ld), dtype),
                                                       spec((3, bplan.tokens), "float32"), vec, spec((1,), "int64"),
                                                       spec((n_tok, D), dtype), spec((V, D), "float32"),
                                                       spec((V,), "float32") if options else None), \
            p=bplan, f=options: bounded_forward(no_gemm, *a, plan=p, alpha=0.5, softcap=30.0 if f else None,
                                                label_smoothing=0.1 if f else 0.0, z_loss=1e-4 if f else 0.0)
