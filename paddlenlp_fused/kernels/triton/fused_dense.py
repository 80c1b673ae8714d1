"""Dense layers in Triton: a GEMM with fused epilogues, and the MLP's elementwise activations.

GEMM ``gemm(a, b, c, ...)``: c[M, N] = epilogue(a[M, K] @ b[K, N]) with a and b at any strides (a
transposed operand is a stride swap), fp32 accumulation (bf16/fp16 tensor cores; fp32 inputs in IEEE
fp32, not tf32). Epilogues, each a compile-time flag:
    bias        + bias[N]
    activation  pre = a @ b (+ bias) rounded to c's dtype, then c = act(pre); ``pre`` optionally
                stored. Rounding first makes c equal ``act_fwd(pre)`` bit for bit, so a backward
                that recomputes the activation from the saved pre-activation gets the same values.
    act_grad    c = (a @ b) * act'(pre[M, N])  (an activation's backward fused into the
                input-gradient GEMM)
Activations: gelu_approx (tanh), gelu (erf), relu, sqrelu (relu squared). ``gemm(..., dbias=...)``
also writes the bias gradient of a weight-gradient GEMM dW = x^T @ dy, dbias[N] = sum over k of
b[k, N], by ``_column_sum`` (one program per column block sums in order: deterministic), a separate
pass over dy: summed inside the GEMM's main loop it gave a wrong dW with the 128x256 3-stage tile on
sm_90 (Triton 3.6), so the reduction stays out of the pipelined loop.

Elementwise ``act_fwd(pre, out)``, ``act_bwd(pre, dout, dpre)`` on contiguous tensors of any shape
(the gated activations are ``gated_activation.py``'s kernels). Column-sum passes for GEMMs that
leave the bias gradient out of their epilogue: ``act_bwd_dbias`` (the activation's backward and the
bias gradient of its result, one pass) and ``column_sum``; each program sums a block of columns over
a share of the rows into a float32 workspace, which a second small kernel sums in order.

Tuned for sm_90: 128x256 / 256x128 / 128x128 tiles, BLOCK_K 64, 8 warps, 3-4 stages, grouped
program order for L2 reuse; autotuned per problem. Triton's interpreter (CPU suite) runs the same
kernels with one small tile (``_TUNED_CONFIGS`` there is just that tile) and dot operands upcast to
fp32 (``interpreter_compat.dot_operand``).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ...runtime import tensor as T
from .gated_activation import _act_and_grad as _gated_act_and_grad
from .interpreter_compat import INTERPRETING, dot_operand

ACTIVATIONS = {"none": 0, "gelu_approx": 1, "gelu": 2, "relu": 3, "sqrelu": 4}
_INV_SQRT2 = tl.constexpr(0.7071067811865476)
_INV_SQRT_2PI = tl.constexpr(0.3989422804014327)
_ELEMENTWISE_BLOCK = 4096


@triton.jit
def _act_and_grad(x, ACTIVATION: tl.constexpr):
    """act(x) and act'(x) for fp32 x."""
    if ACTIVATION == 1:  # gelu, tanh approximation (shared with GeGLU)
        act, grad = _gated_act_and_grad(x, 1)
    elif ACTIVATION == 2:  # gelu, erf
        cdf = 0.5 * (1.0 + tl.math.erf(x * _INV_SQRT2))
        act = x * cdf
        grad = cdf + x * _INV_SQRT_2PI * tl.exp(-0.5 * x * x)
    elif ACTIVATION == 3:  # relu
        act = tl.where(x > 0, x, 0.0)
        grad = tl.where(x > 0, 1.0, 0.0)
    else:  # sqrelu
        r = tl.where(x > 0, x, 0.0)
        act = r * r
        grad = 2.0 * r
    return act, grad


@triton.jit
def _gemm_tile(a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, M, N, K,
               stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_pm,
               HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PRE: tl.constexpr,
               ACT_GRAD: tl.constexpr, FP32_DOT: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    # Grouped order: GROUP_M row blocks sweep the column blocks together, so a B panel stays in L2.
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    group_width = GROUP_M * num_pid_n
    first_m = (pid // group_width) * GROUP_M
    group_m = min(num_pid_m - first_m, GROUP_M)
    pid_m = first_m + (pid % group_width) % group_m
    pid_n = (pid % group_width) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = a_ptr + rm.to(tl.int64)[:, None] * stride_am + rk.to(tl.int64)[None, :] * stride_ak
    b_ptrs = b_ptr + rk.to(tl.int64)[:, None] * stride_bk + rn.to(tl.int64)[None, :] * stride_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_in = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=(rm[:, None] < M) & k_in[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_in[:, None] & (rn[None, :] < N), other=0.0)
        if FP32_DOT:
            acc = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
        else:
            acc = tl.dot(dot_operand(a), dot_operand(b), acc)
        a_ptrs += BLOCK_K * stride_ak
        b_ptrs += BLOCK_K * stride_bk

    mask = (rm[:, None] < M) & (rn[None, :] < N)
    rows = rm.to(tl.int64)[:, None]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + rn, mask=rn < N, other=0.0).to(tl.float32)[None, :]
    if ACT_GRAD:
        pre = tl.load(pre_ptr + rows * stride_pm + rn[None, :], mask=mask, other=0.0).to(tl.float32)
        _, grad = _act_and_grad(pre, ACTIVATION)
        acc = acc * grad
    elif ACTIVATION != 0:
        pre = acc.to(c_ptr.dtype.element_ty)
        if SAVE_PRE:
            tl.store(pre_ptr + rows * stride_pm + rn[None, :], pre, mask=mask)
        acc, _ = _act_and_grad(pre.to(tl.float32), ACTIVATION)
    tl.store(c_ptr + rows * stride_cm + rn[None, :], acc.to(c_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _gemm_kernel(a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, M, N, K,
                 stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_pm,
                 HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SAVE_PRE: tl.constexpr,
                 ACT_GRAD: tl.constexpr, FP32_DOT: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
    _gemm_tile(a_ptr, b_ptr, c_ptr, bias_ptr, pre_ptr, M, N, K, stride_am, stride_ak, stride_bk,
               stride_bn, stride_cm, stride_pm, HAS_BIAS, ACTIVATION, SAVE_PRE, ACT_GRAD,
               FP32_DOT, BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M)


def _prune_by_shared_memory(configs, named_args, **kwargs):
    """Drop tiles whose pipelined operand buffers exceed sm_90's 227 KB (fp32 inputs)."""
    itemsize = T.itemsize(named_args["a_ptr"])
    fit = [c for c in configs if c.num_stages * (c.kwargs["BLOCK_M"] + c.kwargs["BLOCK_N"]) * c.kwargs["BLOCK_K"]
           * itemsize <= 220 * 1024]
    return fit or configs[-1:]


def _config(bm, bn, bk, warps, stages, group_m=8):
    return triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": group_m}, num_warps=warps,
                         num_stages=stages)


if INTERPRETING:  # one small tile: the interpreter's time grows with the tile, not the problem
    _TUNED_CONFIGS = [_config(16, 16, 16, 4, 1, group_m=2)]
else:
    _TUNED_CONFIGS = [_config(128, 256, 64, 8, 3), _config(256, 128, 64, 8, 3), _config(128, 128, 64, 8, 4),
                      _config(128, 128, 32, 4, 4)]
_gemm_tuned = triton.autotune(
    _TUNED_CONFIGS, key=["M", "N", "K", "HAS_BIAS", "ACTIVATION", "SAVE_PRE", "ACT_GRAD"],
    prune_configs_by={"early_config_prune": _prune_by_shared_memory})(_gemm_kernel)


def _matrix(name, t, rows, cols, dtype=None):
    T.check_same_shape(name, t, (rows, cols))
    if dtype is not None and T.dtype_name(t) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {T.dtype_name(t)}")


def _row_major(name, t):
    """Row stride of a 2-D tensor with a unit stride along its last axis."""
    rows, cols = T.shape(t)
    stride_r, stride_c = T.strides(t)
    if cols > 1 and stride_c != 1:
        raise ValueError(f"{name}: last axis must be contiguous, got strides {T.strides(t)}")
    return stride_r


def gemm(a, b, c, bias=None, activation: str = "none", pre=None, act_grad: bool = False, dbias=None,
         trans_a: bool = False, trans_b: bool = False) -> None:
    """c[M,N] = epilogue(op(a)[M,K] @ op(b)[K,N]), written in place; a and b at any strides, given
    as [K,M] / [N,K] and used transposed when ``trans_a`` / ``trans_b``.

    ``bias [N]``: added. ``activation`` with ``pre`` None or [M,N]: c = act(round(a @ b + bias)),
    the rounded pre-activation stored in ``pre`` when given. ``act_grad=True``: c = (a @ b) *
    act'(pre), ``pre`` read. ``dbias [N]`` (float32 or c's dtype): the column sums of op(b).
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    if len(T.shape(a)) != 2 or len(T.shape(b)) != 2:
        raise ValueError(f"a, b: expected 2-D tensors, got {T.shape(a)} and {T.shape(b)}")
    stride_am, stride_ak = T.strides(a)[::-1] if trans_a else T.strides(a)
    stride_bk, stride_bn = T.strides(b)[::-1] if trans_b else T.strides(b)
    M, K = T.shape(a)[::-1] if trans_a else T.shape(a)
    K_b, N = T.shape(b)[::-1] if trans_b else T.shape(b)
    dtype = T.dtype_name(a)
    if K_b != K or T.dtype_name(b) != dtype:
        raise ValueError(f"b: expected {K} rows of dtype {dtype} (after transposes), got {T.shape(b)} "
                         f"{T.dtype_name(b)}")
    _matrix("c", c, M, N, dtype)
    if act_grad and (activation == "none" or pre is None or bias is not None):
        raise ValueError("act_grad: needs an activation and its saved pre-activation, and takes no bias")
    if pre is not None:
        if activation == "none":
            raise ValueError("pre: a pre-activation goes with an activation")
        _matrix("pre", pre, M, N, dtype)
    if bias is not None:
        T.check_same_shape("bias", bias, (N,))
        T.check_contiguous("bias", bias)
    if dbias is not None:
        T.check_same_shape("dbias", dbias, (N,))
        T.check_contiguous("dbias", dbias)
    stride_cm = _row_major("c", c)
    stride_pm = _row_major("pre", pre) if pre is not None else 0
    if N == 0:
        return
    if dbias is not None:
        _column_sum(b, dbias, K, N, stride_bk, stride_bn)
    if M == 0:
        return
    kernel_args = (a, b, c, bias if bias is not None else c, pre if pre is not None else c, M, N, K,
                   stride_am, stride_ak, stride_bk, stride_bn, stride_cm, stride_pm)
    flags = dict(HAS_BIAS=bias is not None, ACTIVATION=ACTIVATIONS[activation],
                 SAVE_PRE=pre is not None and not act_grad, ACT_GRAD=act_grad,
                 FP32_DOT=dtype == "float32")  # IEEE fp32 dot for fp32 inputs (not tf32)
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _gemm_tuned[grid](*kernel_args, **flags)


@triton.jit
def _column_sum_block(x_ptr, out_ptr, K, N, stride_k, stride_n, BLOCK_K: tl.constexpr,
                      BLOCK_N: tl.constexpr):
    """out[N] = sum over k of x[k, N] in fp32; one program per BLOCK_N columns, rows in order."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    ptrs = x_ptr + rk.to(tl.int64)[:, None] * stride_k + cols.to(tl.int64)[None, :] * stride_n
    acc = tl.zeros((BLOCK_K, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        acc += tl.load(ptrs, mask=((k0 + rk) < K)[:, None] & (cols < N)[None, :], other=0.0).to(tl.float32)
        ptrs += BLOCK_K * stride_k
    tl.store(out_ptr + cols, tl.sum(acc, axis=0).to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _column_sum_kernel(x_ptr, out_ptr, K, N, stride_k, stride_n, BLOCK_K: tl.constexpr,
                       BLOCK_N: tl.constexpr):
    _column_sum_block(x_ptr, out_ptr, K, N, stride_k, stride_n, BLOCK_K, BLOCK_N)


def _column_sum(x, out, K, N, stride_k, stride_n):
    """out[N] = column sums of the [K, N] matrix x (any strides)."""
    _column_sum_kernel[(triton.cdiv(N, 128),)](x, out, K, N, stride_k, stride_n, BLOCK_K=32, BLOCK_N=128,
                                               num_warps=8)


@triton.jit
def _act_fwd_kernel(pre_ptr, out_ptr, n, ACTIVATION: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(pre_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    act, _ = _act_and_grad(x, ACTIVATION)
    tl.store(out_ptr + offs, act.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _act_bwd_kernel(pre_ptr, dout_ptr, dpre_ptr, n, ACTIVATION: tl.constexpr,
                    BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(pre_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    dout = tl.load(dout_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    _, grad = _act_and_grad(x, ACTIVATION)
    tl.store(dpre_ptr + offs, (dout * grad).to(dpre_ptr.dtype.element_ty), mask=mask)


def _elementwise(activation, tensors):
    """Checks (name, tensor) pairs of one shape, contiguous; returns size, grid and block."""
    if activation not in ACTIVATIONS or activation == "none":
        raise ValueError(f"activation: expected one of {sorted(set(ACTIVATIONS) - {'none'})}, got {activation!r}")
    shape = T.shape(tensors[0][1])
    for name, t in tensors:
        T.check_same_shape(name, t, shape)
        T.check_contiguous(name, t)
    n = T.numel(tensors[0][1])
    block = 256 if INTERPRETING else _ELEMENTWISE_BLOCK
    return n, (triton.cdiv(n, block),), block


def act_fwd(pre, out, activation: str) -> None:
    """out = act(pre), elementwise, contiguous tensors of one shape."""
    n, grid, block = _elementwise(activation, [("pre", pre), ("out", out)])
    if n:
        _act_fwd_kernel[grid](pre, out, n, ACTIVATION=ACTIVATIONS[activation],
                              BLOCK=block, num_warps=8)


def act_bwd(pre, dout, dpre, activation: str) -> None:
    """dpre = dout * act'(pre), elementwise, contiguous tensors of one shape."""
    n, grid, block = _elementwise(activation, [("pre", pre), ("dout", dout), ("dpre", dpre)])
    if n:
        _act_bwd_kernel[grid](pre, dout, dpre, n, ACTIVATION=ACTIVATIONS[activation],
                              BLOCK=block, num_warps=8)


@triton.jit
def _act_bwd_colsum_kernel(pre_ptr, dout_ptr, dpre_ptr, partial_ptr, M, N, rows_per_split,
                           stride_pre, stride_dout, stride_dpre,
                           ACTIVATION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Over this program's rows [split * rows_per_split, ...) and BLOCK_N columns: dpre = dout *
    act'(pre) (rounded to dpre's dtype, then summed, so the sums are those of the stored values),
    and the fp32 column sums into partial[split, :]. ACTIVATION 0: the column sums of dout only."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    split = tl.program_id(1)
    row_start = split * rows_per_split
    row_end = tl.minimum(row_start + rows_per_split, M)
    rm = tl.arange(0, BLOCK_M)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for m0 in range(row_start, row_end, BLOCK_M):
        rows = (m0 + rm).to(tl.int64)[:, None]
        mask = ((m0 + rm) < row_end)[:, None] & (cols < N)[None, :]
        d = tl.load(dout_ptr + rows * stride_dout + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if ACTIVATION != 0:
            x = tl.load(pre_ptr + rows * stride_pre + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            _, grad = _act_and_grad(x, ACTIVATION)
            d = (d * grad).to(dpre_ptr.dtype.element_ty)
            tl.store(dpre_ptr + rows * stride_dpre + cols[None, :], d, mask=mask)
            d = d.to(tl.float32)
        acc += d
    tl.store(partial_ptr + split.to(tl.int64) * N + cols, tl.sum(acc, axis=0), mask=cols < N)


@triton.jit
def _sum_partials_kernel(partial_ptr, out_ptr, splits, N, BLOCK_N: tl.constexpr):
    """out[N] = sum over s of partial[s, N], in order of s (deterministic)."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for s in range(0, splits):
        acc += tl.load(partial_ptr + s * N + cols, mask=cols < N, other=0.0)
    tl.store(out_ptr + cols, acc.to(out_ptr.dtype.element_ty), mask=cols < N)


# Column-sum passes: tiles of BLOCK_M x BLOCK_N, the rows split so that about _COLSUM_PROGRAMS
# programs run (a few per SM: enough bytes in flight for a memory-bound pass).
if INTERPRETING:
    _COLSUM_TILE, _COLSUM_PROGRAMS, _COLSUM_WARPS = (8, 16), 16, 1
else:
    _COLSUM_TILE, _COLSUM_PROGRAMS, _COLSUM_WARPS = (32, 128), 1024, 4


def colsum_partial_shape(M: int, N: int):
    """Shape of the float32 workspace ``act_bwd_dbias`` and ``column_sum`` take for an [M, N] input:
    (row splits, N)."""
    block_m, block_n = _COLSUM_TILE
    row_blocks = max(triton.cdiv(M, block_m), 1)
    per_split = triton.cdiv(row_blocks, max(1, min(row_blocks, triton.cdiv(_COLSUM_PROGRAMS, triton.cdiv(N, block_n)))))
    return (triton.cdiv(row_blocks, per_split), N)


def _colsum_pass(pre, dout, dpre, dbias, partial, activation):
    M, N = T.shape(dout)
    for name, t in (("pre", pre), ("dpre", dpre)):
        if t is not None:
            T.check_rows(name, t, M, N)
            if T.dtype_name(t) != T.dtype_name(dout):
                raise TypeError(f"{name}: expected dtype {T.dtype_name(dout)} (dout's), got {T.dtype_name(t)}")
    T.check_same_shape("dbias", dbias, (N,))
    T.check_contiguous("dbias", dbias)
    shape = colsum_partial_shape(M, N)
    T.check_same_shape("partial", partial, shape)
    T.check_contiguous("partial", partial)
    if T.dtype_name(partial) != "float32":
        raise TypeError(f"partial: expected dtype float32, got {T.dtype_name(partial)}")
    if N == 0:
        return
    block_m, block_n = _COLSUM_TILE
    splits = shape[0]
    rows_per_split = triton.cdiv(max(triton.cdiv(M, block_m), 1), splits) * block_m
    pre_, dpre_ = (pre, dpre) if pre is not None else (dout, dout)
    _act_bwd_colsum_kernel[(triton.cdiv(N, block_n), splits)](
        pre_, dout, dpre_, partial, M, N, rows_per_split, T.strides(pre_)[0], T.strides(dout)[0],
        T.strides(dpre_)[0], ACTIVATION=ACTIVATIONS[activation], BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=_COLSUM_WARPS)
    _sum_partials_kernel[(triton.cdiv(N, 256),)](partial, dbias, splits, N, BLOCK_N=256, num_warps=4)


def act_bwd_dbias(pre, dout, dpre, dbias, partial, activation: str) -> None:
    """One pass over [M, N] matrices (last axis contiguous, rows at any stride): dpre = dout *
    act'(pre) and dbias[N] = dpre.sum(0) (fp32 sums of the stored dpre, in a fixed order). ``partial``:
    a float32 workspace of ``colsum_partial_shape(M, N)``."""
    if activation not in ACTIVATIONS or activation == "none":
        raise ValueError(f"activation: expected one of {sorted(set(ACTIVATIONS) - {'none'})}, got {activation!r}")
    if len(T.shape(dout)) != 2:
        raise ValueError(f"dout: expected a 2-D tensor [M, N], got shape {T.shape(dout)}")
    T.check_rows("dout", dout, *T.shape(dout))
    _colsum_pass(pre, dout, dpre, dbias, partial, activation)


def column_sum(x, out, partial) -> None:
    """out[N] = x.sum(0) for an [M, N] matrix x (last axis contiguous), in fp32 in a fixed order;
    ``partial``: a float32 workspace of ``colsum_partial_shape(M, N)``."""
    if len(T.shape(x)) != 2:
        raise ValueError(f"x: expected a 2-D tensor [M, N], got shape {T.shape(x)}")
    T.check_rows("x", x, *T.shape(x))
    _colsum_pass(None, x, None, out, partial, "none")


def compile_cases():
    """The compile-only check's launches: the GEMM's epilogue variants at the MLP's bf16 shape (every
    autotune config), fp16/fp32 plain GEMMs, and the elementwise kernels for each activation."""
    M, K, H = 16384, 4096, 16384
    bf16 = "bfloat16"
    x, w1, pre = T.SpecTensor((M, K), bf16), T.SpecTensor((K, H), bf16), T.SpecTensor((M, H), bf16)
    out1, bias = T.SpecTensor((M, H), bf16), T.SpecTensor((H,), bf16)
    w2 = T.SpecTensor((H, K), bf16)
    dout, dx = T.SpecTensor((M, K), bf16), T.SpecTensor((M, K), bf16)
    dw1, db1 = T.SpecTensor((K, H), bf16), T.SpecTensor((H,), bf16)
    yield "gemm[bf16,bias+gelu_approx+pre]", lambda: gemm(x, w1, out1, bias=bias, activation="gelu_approx", pre=pre)
    yield "gemm[bf16,act_grad gelu_approx]", \
        lambda: gemm(dout, w2, out1, activation="gelu_approx", pre=pre, act_grad=True, trans_b=True)
    yield "gemm[bf16,bias_grad,a transposed]", lambda: gemm(x, pre, dw1, dbias=db1, trans_a=True)
    yield "gemm[bf16,b transposed]", lambda: gemm(pre, w1, dx, trans_b=True)
    for dtype in ("float16", "float32"):
        a, b, c = T.SpecTensor((1000, 333), dtype), T.SpecTensor((333, 77), dtype), T.SpecTensor((1000, 77), dtype)
        yield f"gemm[{dtype},plain]", lambda a=a, b=b, c=c: gemm(a, b, c)
    for activation in ACTIVATIONS:
        if activation == "none":
            continue
        p, o = T.SpecTensor((M, H), bf16), T.SpecTensor((M, H), bf16)
        yield f"act_fwd[{activation}]", lambda p=p, o=o, a=activation: act_fwd(p, o, a)
        yield f"act_bwd[{activation}]", lambda p=p, o=o, a=activation: act_bwd(p, o, o, a)
        ws = T.SpecTensor(colsum_partial_shape(M, H), "float32")
        yield f"act_bwd_dbias[{activation}]", \
            lambda p=p, o=o, a=activation, ws=ws: act_bwd_dbias(p, o, o, bias, ws, a)
    for dtype in T.FLOAT_DTYPES:
        p, o, b = T.SpecTensor((M, H), dtype), T.SpecTensor((M, H), dtype), T.SpecTensor((H,), dtype)
        ws = T.SpecTensor(colsum_partial_shape(M, H), "float32")
        yield f"act_bwd_dbias[{dtype},gelu_approx]", \
            lambda p=p, o=o, b=b, ws=ws: act_bwd_dbias(p, o, o, b, ws, "gelu_approx")
        y, db = T.SpecTensor((M, K), dtype), T.SpecTensor((K,), dtype)
        yield f"column_sum[{dtype}]", \
            lambda y=y, db=db: column_sum(y, db, T.SpecTensor(colsum_partial_shape(M, K), "float32"))
