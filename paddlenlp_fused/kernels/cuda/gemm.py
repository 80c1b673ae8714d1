"""One generic cuBLASLt GEMM (``pnf_gemm`` in ``csrc/fused_dense.cu``) behind ctypes; framework-neutral.

    gemm(a, b, d, workspace, m=, n=, k=)   D[m,n] = alpha op(A) @ op(B) + beta D

Row-major operands given as a tensor plus an element offset and a row stride, so blocks of larger
tensors (a chunk of tokens, of vocabulary rows, of a gradient) take no copy: op(A) is A[m,k] or,
with ``trans_a``, A[k,m] transposed; likewise B. A and B share a dtype (float16 / bfloat16 / float32);
D has it too or is float32 (16-bit products accumulated in an fp32 buffer). fp32 accumulation; beta = 0
does not read D. ``workspace``: a uint8 tensor (``fused_dense.workspace_bytes``). ``a_dtype`` /
``b_dtype`` read an operand's memory as another dtype (a 16-bit matrix written over an fp32 buffer);
its offset and row stride then count elements of that dtype.
"""

from __future__ import annotations

import ctypes

from ...runtime import tensor as T
from . import fused_dense, library

_i64, _ptr, _int, _size, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t, ctypes.c_float
_ARGTYPES = [_int, _int, _int, _int, _i64, _i64, _i64, _f32, _ptr, _i64, _ptr, _i64, _f32, _ptr, _i64, _int, _ptr,
             _size, _ptr]
_declared: dict = {}


def available():
    """(available, reason) of the cuBLASLt GEMM."""
    return fused_dense.status()


def _lib() -> ctypes.CDLL:
    lib = fused_dense._lib()
    if _declared.get("lib") is not lib:
        lib.pnf_gemm.argtypes, lib.pnf_gemm.restype = _ARGTYPES, _int
        _declared["lib"] = lib
    return lib


def _operand(name: str, t, offset: int, rows: int, cols: int, ld, dtype: str) -> int:
    """Checks that rows x cols elements of ``dtype`` with row stride ``ld`` from ``offset`` lie inside
    ``t``, whose last axis is contiguous; returns the row stride."""
    if T.device_kind(t) != "gpu":
        raise ValueError(f"{name}: the CUDA GEMM takes GPU tensors")
    strides = T.strides(t)
    if strides and strides[-1] != 1 and T.numel(t) > 1:
        raise ValueError(f"{name}: last axis must be contiguous, got strides {strides}")
    per = T.itemsize(t) / T.itemsize(dtype)  # elements of dtype in one of t's
    if ld is None:
        ld = int(strides[-2] * per) if len(strides) >= 2 else cols
    if rows > 1 and ld < cols:
        raise ValueError(f"{name}: row stride {ld} is below the row width {cols}")
    end, size = offset + (rows - 1) * ld + cols, int(T.numel(t) * per)
    if offset < 0 or end > size:
        raise ValueError(f"{name}: a {rows} x {cols} block with row stride {ld} at offset {offset} runs past its "
                         f"{size} elements")
    return max(int(ld), 1)


def gemm(a, b, d, workspace, *, m: int, n: int, k: int, trans_a: bool = False, trans_b: bool = False,
         alpha: float = 1.0, beta: float = 0.0, a_offset: int = 0, b_offset: int = 0, d_offset: int = 0,
         lda=None, ldb=None, ldd=None, heuristic: int = 0, a_dtype: str | None = None,
         b_dtype: str | None = None) -> None:
    """D[m,n] = alpha op(A) @ op(B) + beta D on the current stream of ``a``'s framework (see module doc)."""
    dtype = a_dtype or T.dtype_name(a)
    if (b_dtype or T.dtype_name(b)) != dtype:
        raise TypeError(f"b: expected dtype {dtype} (as a), got {b_dtype or T.dtype_name(b)}")
    d_dtype = T.dtype_name(d)
    if d_dtype not in (dtype, "float32"):
        raise TypeError(f"d: expected dtype {dtype} or float32, got {d_dtype}")
    if min(m, n, k) <= 0:
        raise ValueError(f"m, n, k: the CUDA GEMM takes no empty dimension, got {m}, {n}, {k}")
    if T.dtype_name(workspace) != "uint8" or len(T.shape(workspace)) != 1:
        raise ValueError(f"workspace: expected a 1-D uint8 tensor, got {T.shape(workspace)} {T.dtype_name(workspace)}")
    lda = _operand("a", a, a_offset, *((k, m) if trans_a else (m, k)), lda, dtype)
    ldb = _operand("b", b, b_offset, *((n, k) if trans_b else (k, n)), ldb, dtype)
    ldd = _operand("d", d, d_offset, m, n, ldd, d_dtype)
    size, d_size = T.itemsize(dtype), T.itemsize(d_dtype)
    status = _lib().pnf_gemm(
        library.dtype_code(dtype), library.dtype_code(d_dtype), int(trans_a), int(trans_b), m, n, k, float(alpha),
        a.data_ptr() + a_offset * size, lda, b.data_ptr() + b_offset * size, ldb, float(beta),
        d.data_ptr() + d_offset * d_size, ldd, int(heuristic), workspace.data_ptr(), T.numel(workspace),
        library.stream_of(a))
    if status in fused_dense._DETAILED_STATUS:
        raise RuntimeError(f"pnf_gemm: {fused_dense._DETAILED_STATUS[status]}: "
                           f"{_lib().pnf_fused_dense_last_error().decode()}")
    library.check(status, "pnf_gemm")
