"""cuBLASLt fused dense GEMMs (``csrc/fused_dense.cu``) behind ctypes; framework-neutral.

Row-major tensors in Paddle's weight layout (``weight [in, out]``); every matrix has a unit stride
along its last axis and any row stride (``ld``) at least its width. dtypes float16 / bfloat16 /
float32, fp32 accumulation.

    linear_act_fwd   out[M,N] = act(x[M,K] @ W + bias)  (W [K,N], or W [N,K] used transposed),
                     act in {"none", "gelu_approx", "relu"}; optional ``aux``: the pre-activation
                     (gelu_approx: values [M, round_up(N, 8)] of x's dtype; relu: a bit mask, uint8
                     [M, round_up(N, 128) / 8])
    linear_wgrad     dW[K,N] = x[M,K]^T @ dout[M,N] and dbias[N] = dout.sum(0), one GEMM
    linear_act_bwd   dpre[M,H] = act'(pre) * (dout[M,N] @ W[H,N]^T) and dbias[H] = dpre.sum(0), one
                     GEMM, reading the ``aux`` that linear_act_fwd saved

``heuristic`` indexes cuBLASLt's list of algorithms for the problem (0: its first choice; an index
past the end takes the last). ``workspace``: a uint8 tensor of ``workspace_bytes(device)`` bytes
(32 MiB on sm_90), allocated by the caller.
"""

from __future__ import annotations

import ctypes
import glob
import importlib.util
import os
from typing import Optional, Tuple

from ...runtime import tensor as T
from . import library

ACTIVATIONS = {"none": 0, "gelu_approx": 1, "relu": 2}
ENV_CUBLASLT = "PADDLENLP_FUSED_CUBLASLT"
_i64, _ptr, _int, _size = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t
_SIGNATURES = {
    "pnf_fused_dense_fwd": [_int, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _int, _ptr, _i64, _ptr, _i64,
                            _int, _ptr, _size, _ptr],
    "pnf_fused_dense_wgrad": [_int, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _ptr, _int, _ptr, _size,
                              _ptr],
    "pnf_fused_dense_bwd_act": [_int, _i64, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64, _int, _ptr, _i64, _ptr,
                                _int, _ptr, _size, _ptr],
}
# PnfStatus codes whose detail this family records (pnf_fused_dense_last_error); 3 (CUDA) goes
# through library.check.
_DETAILED_STATUS = {1: "invalid argument", 2: "unsupported case", 4: "cuBLASLt error"}
_state: dict = {}


def _cublaslt_candidates():
    """Where cuBLASLt may be: $PADDLENLP_FUSED_CUBLASLT, the loader's search path (None), then the
    ``nvidia-cublas`` pip package (torch's and Paddle's CUDA 12/13 wheels install it)."""
    env = os.environ.get(ENV_CUBLASLT)
    if env:
        return [env]
    found = [None]
    spec = importlib.util.find_spec("nvidia")
    for root in (spec.submodule_search_locations or []) if spec else []:
        for pattern in ("cu13/lib/libcublasLt.so.13", "cublas/lib/libcublasLt.so.13", "cu12/lib/libcublasLt.so.12",
                        "cublas/lib/libcublasLt.so.12"):
            found += sorted(glob.glob(os.path.join(root, pattern)))
    return found


def _load() -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    if "lib" in _state or "error" in _state:
        return _state.get("lib"), _state.get("error")
    lib, error = library.load()
    if lib is None:
        _state["error"] = error
        return None, error
    lib.pnf_fused_dense_init.argtypes = [ctypes.c_char_p]
    lib.pnf_fused_dense_last_error.restype = ctypes.c_char_p
    lib.pnf_fused_dense_cublaslt_version.restype = _size
    lib.pnf_fused_dense_workspace_bytes.restype = _size
    lib.pnf_fused_dense_workspace_bytes.argtypes = [_int]
    for name, argtypes in _SIGNATURES.items():
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = _int
    reasons = []
    for path in _cublaslt_candidates():
        if lib.pnf_fused_dense_init(path.encode() if path else None) == 0:
            _state["lib"] = lib
            return lib, None
        reasons.append(lib.pnf_fused_dense_last_error().decode())
    _state["error"] = "cuBLASLt not found: " + "; ".join(reasons) + f" (set ${ENV_CUBLASLT} to libcublasLt.so)"
    return None, _state["error"]


def status() -> Tuple[bool, str]:
    """(available, reason) of the cuBLASLt fused dense kernels."""
    lib, error = _load()
    if lib is None:
        return False, error
    return True, f"cuBLASLt {lib.pnf_fused_dense_cublaslt_version()}"


def _lib() -> ctypes.CDLL:
    lib, error = _load()
    if lib is None:
        raise RuntimeError(f"cuBLASLt fused dense kernels unavailable: {error}")
    return lib


def workspace_bytes(device: int = 0) -> int:
    """Bytes of cuBLASLt workspace to pass for a GPU: 32 MiB on sm_90 and later, 4 MiB before."""
    n = _lib().pnf_fused_dense_workspace_bytes(int(device))
    if n == 0:
        library.check(3, "fused_dense workspace_bytes")
    return int(n)


def aux_shape(activation: str, M: int, N: int) -> Tuple[Tuple[int, int], Optional[str]]:
    """Shape and dtype (None: the activations' dtype) of the pre-activation buffer that
    ``linear_act_fwd`` saves for ``activation`` on an [M, N] output; cuBLASLt wants its rows padded
    (to 8 values for GELU, to 128 bits for the ReLU mask)."""
    if activation == "gelu_approx":
        return (M, -(-N // 8) * 8), None
    if activation == "relu":
        return (M, -(-N // 128) * 16), "uint8"
    raise ValueError(f"activation: cuBLASLt saves a pre-activation for 'gelu_approx' or 'relu', got {activation!r}")


def _matrix(name: str, t, rows: int, cols: int, dtype: Optional[str] = None) -> int:
    """Checks a row-major [rows, cols] matrix with unit column stride; returns its row stride."""
    T.check_same_shape(name, t, (rows, cols))
    if dtype is not None and T.dtype_name(t) != dtype:
        raise TypeError(f"{name}: expected dtype {dtype}, got {T.dtype_name(t)}")
    if T.device_kind(t) != "gpu":
        raise ValueError(f"{name}: the CUDA kernels take GPU tensors")
    stride_r, stride_c = T.strides(t)
    if cols > 1 and stride_c != 1:
        raise ValueError(f"{name}: last axis must be contiguous, got strides {T.strides(t)}")
    if rows > 1 and stride_r < cols:
        raise ValueError(f"{name}: row stride {stride_r} is below the row width {cols}")
    return stride_r if rows > 1 else max(cols, 1)


def _ptr_of(t) -> Optional[int]:
    return None if t is None else t.data_ptr()


def _call(name: str, *args) -> None:
    status_code = getattr(_lib(), name)(*args)
    if status_code in _DETAILED_STATUS:
        detail = _lib().pnf_fused_dense_last_error().decode()
        raise RuntimeError(f"{name}: {_DETAILED_STATUS[status_code]}: {detail}")
    library.check(status_code, name)


def _common(x, workspace, heuristic):
    dtype = T.dtype_name(x)
    if heuristic < 0:
        raise ValueError(f"heuristic: expected an index >= 0, got {heuristic}")
    if T.dtype_name(workspace) != "uint8" or len(T.shape(workspace)) != 1:
        raise ValueError(f"workspace: expected a 1-D uint8 tensor, got {T.shape(workspace)} {T.dtype_name(workspace)}")
    return library.dtype_code(dtype), dtype, workspace.data_ptr(), T.numel(workspace), library.stream_of(x)


def linear_act_fwd(x, weight, out, workspace, bias=None, activation: str = "none", aux=None,
                   weight_transposed: bool = False, heuristic: int = 0) -> None:
    """out[M,N] = act(x[M,K] @ W + bias[N]); W = weight [K,N], or weight [N,K] transposed when
    ``weight_transposed``. With ``aux`` (shape from ``aux_shape``) the pre-activation is saved."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation: expected one of {sorted(ACTIVATIONS)}, got {activation!r}")
    code, dtype, ws, ws_bytes, stream = _common(x, workspace, heuristic)
    M, K = T.shape(x)
    N = T.shape(weight)[0 if weight_transposed else 1]
    ldx = _matrix("x", x, M, K, dtype)
    ldw = _matrix("weight", weight, *((N, K) if weight_transposed else (K, N)), dtype)
    ldo = _matrix("out", out, M, N, dtype)
    if bias is not None:
        T.check_same_shape("bias", bias, (N,))
        T.check_contiguous("bias", bias)
    ld_aux = 0
    if aux is not None:
        if activation == "none":
            raise ValueError("aux: a pre-activation is saved only with an activation")
        shape, aux_dtype = aux_shape(activation, M, N)
        _matrix("aux", aux, *shape, aux_dtype or dtype)
        T.check_contiguous("aux", aux)
        ld_aux = shape[1] * (8 if activation == "relu" else 1)
    if min(M, N, K) == 0:
        raise ValueError(f"x, weight: the CUDA GEMM takes no empty dimension, got M={M} N={N} K={K}")
    _call("pnf_fused_dense_fwd", code, M, N, K, x.data_ptr(), ldx, weight.data_ptr(), ldw, int(weight_transposed),
          _ptr_of(bias), ACTIVATIONS[activation], out.data_ptr(), ldo, _ptr_of(aux), ld_aux, int(heuristic), ws,
          ws_bytes, stream)


def linear_wgrad(x, dout, dweight, workspace, dbias=None, heuristic: int = 0) -> None:
    """dweight[K,N] = x[M,K]^T @ dout[M,N]; with ``dbias`` also dbias[N] = dout.sum(0) (same GEMM)."""
    code, dtype, ws, ws_bytes, stream = _common(x, workspace, heuristic)
    M, K = T.shape(x)
    N = T.shape(dout)[1]
    ldx = _matrix("x", x, M, K, dtype)
    lddout = _matrix("dout", dout, M, N, dtype)
    lddw = _matrix("dweight", dweight, K, N, dtype)
    if dbias is not None:
        T.check_same_shape("dbias", dbias, (N,))
        T.check_contiguous("dbias", dbias)
    if min(M, N, K) == 0:
        raise ValueError(f"x, dout: the CUDA GEMM takes no empty dimension, got M={M} N={N} K={K}")
    _call("pnf_fused_dense_wgrad", code, M, K, N, x.data_ptr(), ldx, dout.data_ptr(), lddout, dweight.data_ptr(),
          lddw, _ptr_of(dbias), int(heuristic), ws, ws_bytes, stream)


def linear_act_bwd(dout, weight, aux, dpre, workspace, dbias=None, activation: str = "gelu_approx",
                   heuristic: int = 0) -> None:
    """dpre[M,H] = act'(pre) * (dout[M,N] @ weight[H,N]^T), ``aux`` the pre-activation saved by
    ``linear_act_fwd``; with ``dbias`` also dbias[H] = dpre.sum(0) (same GEMM)."""
    if activation not in ("gelu_approx", "relu"):
        raise ValueError(f"activation: expected 'gelu_approx' or 'relu', got {activation!r}")
    code, dtype, ws, ws_bytes, stream = _common(dout, workspace, heuristic)
    M, N = T.shape(dout)
    H = T.shape(weight)[0]
    lddout = _matrix("dout", dout, M, N, dtype)
    ldw = _matrix("weight", weight, H, N, dtype)
    lddpre = _matrix("dpre", dpre, M, H, dtype)
    shape, aux_dtype = aux_shape(activation, M, H)
    _matrix("aux", aux, *shape, aux_dtype or dtype)
    T.check_contiguous("aux", aux)
    if dbias is not None:
        T.check_same_shape("dbias", dbias, (H,))
        T.check_contiguous("dbias", dbias)
    if min(M, N, H) == 0:
        raise ValueError(f"dout, weight: the CUDA GEMM takes no empty dimension, got M={M} N={N} H={H}")
    _call("pnf_fused_dense_bwd_act", code, M, H, N, dout.data_ptr(), lddout, weight.data_ptr(), ldw, aux.data_ptr(),
          shape[1] * (8 if activation == "relu" else 1), ACTIVATIONS[activation], dpre.data_ptr(), lddpre,
          _ptr_of(dbias), int(heuristic), ws, ws_bytes, stream)
