"""LayerNorm / RMSNorm on the CUDA kernels of ``csrc/norm.cu`` (ctypes over the C ABI).

The launchers mirror ``kernels/triton/norm.py`` for the ungrouped norms (no gate): same tensors,
shapes and workspaces (see that module's docstring), written in place on the tensors' current
stream. The backward sums dweight/dbias over rows in two kernels launched by one call.
"""

from __future__ import annotations

import ctypes
from typing import NamedTuple, Optional

from ...runtime import tensor as T
from . import library

_c_ptr, _c_i64, _c_int, _c_float = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int, ctypes.c_float
_SIGNATURES = {
    "pnf_norm_fwd": [_c_ptr] * 8 + [_c_i64] * 6 + [_c_int] * 4 + [_c_float, _c_float] + [_c_int] * 4 + [_c_ptr],
    "pnf_norm_bwd_workspace": [_c_int, _c_i64, _c_i64] + [_c_int] * 3 + [ctypes.POINTER(_c_i64), ctypes.POINTER(_c_int)],
    "pnf_norm_bwd": [_c_ptr] * 12 + [_c_i64] * 8 + [_c_int] * 5 + [_c_float] + [_c_int] * 4 + [_c_ptr],
}
_lib = library.bound(_SIGNATURES)


def _ptr(t) -> int | None:
    return None if t is None else t.data_ptr()


def _code(t, default: int = 0) -> int:
    return default if t is None else library.dtype_code(T.dtype_name(t))


def _check_vectors(named, length: int) -> None:
    for name, t in named:
        if t is not None:
            shape = T.shape(t)
            if shape != (length,):
                raise ValueError(f"{name}: expected shape {(length,)}, got {shape}")
            if length > 1 and T.strides(t)[0] != 1:
                raise ValueError(f"{name}: launcher expects a contiguous tensor, got strides {T.strides(t)}")


def _check_fp32(named) -> None:
    for name, t in named:
        if t is not None and T.dtype_name(t) != "float32":
            raise TypeError(f"{name}: expected float32, got {T.dtype_name(t)}")


def _matrix_shape(name: str, t) -> tuple:
    shape = T.shape(t)
    if len(shape) != 2:
        raise ValueError(f"{name}: expected a 2-D tensor [M, N], got shape {shape}")
    return shape


def _check_weight_dtypes(weight, others) -> None:
    for name, t in others:
        if t is not None and T.dtype_name(t) != T.dtype_name(weight):
            raise TypeError(f"{name}: expected the weight's dtype {T.dtype_name(weight)}, got {T.dtype_name(t)}")


class NormVariant(NamedTuple):
    """A kernel variant of the library (benchmarks and variant tests); None takes the library's
    own choice by row width and dtype. ``items``: 16-byte vectors per thread (1 or 2); ``stages``:
    rows staged in shared memory (0: the block-per-row kernel, 2 or 3: the staged persistent one,
    for aligned rows of at most 1024 vectors and no residual); ``blocks_per_sm`` of that one."""
    items: Optional[int] = None
    stages: Optional[int] = None
    blocks_per_sm: Optional[int] = None

    def c_args(self) -> tuple:
        return (0 if self.items is None else int(self.items), -1 if self.stages is None else int(self.stages),
                0 if self.blocks_per_sm is None else int(self.blocks_per_sm))


def bwd_workspace_shapes(M: int, N: int, dtype: str, has_bias: bool, *, variant: NormVariant = NormVariant()):
    """(partials [n_sums, P, N], rowstats [M, 2] or None): the fp32 workspaces ``norm_bwd`` takes;
    P fills the current device at the backward kernel's occupancy. ``variant``: as passed to
    ``norm_bwd``."""
    num_partials, needs_rowstats = _c_i64(), _c_int()
    library.check(_lib().pnf_norm_bwd_workspace(library.dtype_code(dtype), M, N, *variant.c_args(),
                                                 ctypes.byref(num_partials), ctypes.byref(needs_rowstats)),
                  "norm_bwd_workspace")
    return (2 if has_bias else 1, num_partials.value, N), ((M, 2) if needs_rowstats.value else None)


def norm_fwd(x, weight, bias, y, mean, rstd, *, residual=None, residual_out=None, eps: float = 1e-5,
             is_rms_norm: bool = False, weight_offset: float = 0.0, variant: NormVariant = NormVariant()) -> None:
    """y = norm(x (+ residual)); writes y, residual_out (if given), mean (LayerNorm) and rstd.
    ``variant`` overrides the library's choice of kernel."""
    M, N = _matrix_shape("x", x)
    stride_x, stride_res, stride_y, stride_res_out = (
        T.row_stride(name, t, M, N) for name, t in (("x", x), ("residual", residual), ("y", y),
                                                   ("residual_out", residual_out)))
    if not is_rms_norm and mean is None:
        raise ValueError("mean: LayerNorm needs the [M] fp32 mean buffer")
    _check_vectors((("weight", weight), ("bias", bias)), N)
    _check_vectors((("mean", None if is_rms_norm else mean), ("rstd", rstd)), M)
    _check_weight_dtypes(weight, (("bias", bias),))
    _check_fp32((("mean", mean), ("rstd", rstd)))
    if T.dtype_name(y) != T.dtype_name(x):
        raise TypeError(f"y: expected x's dtype {T.dtype_name(x)}, got {T.dtype_name(y)}")
    library.check(_lib().pnf_norm_fwd(
        _ptr(x), _ptr(residual), _ptr(weight), _ptr(bias), _ptr(y), _ptr(residual_out),
        None if is_rms_norm else _ptr(mean), _ptr(rstd), M, N, stride_x, stride_res, stride_y, stride_res_out,
        _code(x), _code(residual), _code(residual_out),
        _code(weight), float(eps), float(weight_offset), int(is_rms_norm), *variant.c_args(),
        library.stream_of(x)), "norm_fwd")


def norm_bwd(h, weight, mean, rstd, dy, dx, dweight, partials, *, dbias=None, dresidual_out=None,
             dresidual=None, rowstats=None, is_rms_norm: bool = False, weight_offset: float = 0.0,
             variant: NormVariant = NormVariant()) -> None:
    """Gradients of ``norm_fwd`` (h: residual_out when the forward stored one, else x): dx (= dh,
    plus dresidual_out), dresidual (dh in its own dtype), dweight, dbias. ``variant``: as passed
    to ``bwd_workspace_shapes``."""
    M, N = _matrix_shape("h", h)
    stride_h, stride_dy, stride_dx, stride_dres_out, stride_dres = (
        T.row_stride(name, t, M, N) for name, t in (("h", h), ("dy", dy), ("dx", dx), ("dresidual_out", dresidual_out),
                                                   ("dresidual", dresidual)))
    if T.dtype_name(dy) != T.dtype_name(dx):
        raise TypeError(f"dx: expected dy's dtype {T.dtype_name(dy)}, got {T.dtype_name(dx)}")
    if not is_rms_norm and mean is None:
        raise ValueError("mean: LayerNorm needs the [M] fp32 mean buffer")
    _check_vectors((("weight", weight), ("dweight", dweight), ("dbias", dbias)), N)
    _check_vectors((("mean", None if is_rms_norm else mean), ("rstd", rstd)), M)
    _check_weight_dtypes(weight, (("dweight", dweight), ("dbias", dbias)))
    n_sums, shape = 2 if dbias is not None else 1, T.shape(partials)
    if len(shape) != 3 or shape[0] != n_sums or shape[1] < 1 or shape[2] != N:
        raise ValueError(f"partials: expected an fp32 workspace [{n_sums}, P >= 1, {N}], got shape {shape}")
    _check_fp32((("partials", partials), ("rowstats", rowstats), ("mean", mean), ("rstd", rstd)))
    T.check_contiguous("partials", partials)
    if rowstats is not None:  # the library says when it needs one (bwd_workspace_shapes)
        T.check_same_shape("rowstats", rowstats, (M, 2))
        T.check_contiguous("rowstats", rowstats)
    library.check(_lib().pnf_norm_bwd(
        _ptr(h), _ptr(weight), None if is_rms_norm else _ptr(mean), _ptr(rstd), _ptr(dy), _ptr(dresidual_out),
        _ptr(dx), _ptr(dresidual), _ptr(dweight), _ptr(dbias), _ptr(partials),
        _ptr(rowstats), shape[1], M, N, stride_h, stride_dy, stride_dres_out, stride_dx, stride_dres, _code(dy), _code(h),
        _code(dresidual_out), _code(dresidual), _code(weight), float(weight_offset), int(is_rms_norm),
        *variant.c_args(), library.stream_of(dy)), "norm_bwd")
