"""Loading ``libpaddlenlp_fused_cuda.so`` (built from ``csrc/`` by setup.py) with ctypes.

The library is looked for at ``$PADDLENLP_FUSED_CUDA_LIB`` or ``paddlenlp_fused/_lib/``. Its ABI
version must match ``ABI_VERSION``. Entry points return a status code; ``check`` turns a non-zero
one into an exception naming the op.
"""

from __future__ import annotations

import ctypes
import os
import pathlib
from typing import Optional, Tuple

ABI_VERSION = 2
LIB_NAME = "libpaddlenlp_fused_cuda.so"
DTYPE_CODES = {"float32": 0, "float16": 1, "bfloat16": 2}  # PnfDtype in csrc/pnf.h
_STATUS = {1: "invalid argument", 2: "unsupported case", 3: "CUDA error", 4: "cuBLAS error"}

_lib: Optional[ctypes.CDLL] = None
_error: Optional[str] = None


def library_path() -> pathlib.Path:
    env = os.environ.get("PADDLENLP_FUSED_CUDA_LIB")
    if env:
        return pathlib.Path(env)
    return pathlib.Path(__file__).resolve().parents[2] / "_lib" / LIB_NAME


def load() -> Tuple[Optional[ctypes.CDLL], Optional[str]]:
    """(library, None) or (None, why it is unavailable); loads once."""
    global _lib, _error
    if _lib is not None or _error is not None:
        return _lib, _error
    path = library_path()
    if not path.is_file():
        _error = f"{path} is not built (install with nvcc on PATH, or set PADDLENLP_FUSED_CUDA_LIB)"
        return None, _error
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        _error = f"cannot load {path}: {exc}"
        return None, _error
    lib.pnf_abi_version.restype = ctypes.c_int
    lib.pnf_last_cuda_error.restype = ctypes.c_char_p
    version = lib.pnf_abi_version()
    if version != ABI_VERSION:
        _error = f"{path} has ABI version {version}, this package expects {ABI_VERSION}: rebuild it"
        return None, _error
    _lib = lib
    return _lib, None


def get() -> ctypes.CDLL:
    lib, error = load()
    if lib is None:
        raise RuntimeError(f"CUDA kernel library unavailable: {error}")
    return lib


def bound(signatures: dict):
    """A getter of the loaded library with ``signatures`` ({entry point: argtypes}, each returning a
    PnfStatus int) declared; it declares them again if the library is reloaded."""
    declared = {"lib": None}

    def get_declared() -> ctypes.CDLL:
        lib = get()
        if declared["lib"] is not lib:
            for name, argtypes in signatures.items():
                fn = getattr(lib, name)
                fn.argtypes, fn.restype = argtypes, ctypes.c_int
            declared["lib"] = lib
        return lib
    return get_declared


def check(status: int, op: str) -> None:
    if status == 0:
        return
    detail = get().pnf_last_cuda_error().decode() if status == 3 else ""
    raise RuntimeError(f"{op}: CUDA kernel failed with {_STATUS.get(status, status)} {detail}".rstrip())


def dtype_code(name: str) -> int:
    if name not in DTYPE_CODES:
        raise TypeError(f"CUDA kernels take {sorted(DTYPE_CODES)}, got {name!r}")
    return DTYPE_CODES[name]


def stream_of(t) -> int:
    """The raw CUDA stream that work on ``t`` should use: Paddle's or torch's current stream."""
    place = getattr(t, "place", None)
    if place is not None:  # Paddle
        import paddle

        getter = getattr(paddle._C, "_cuda_getCurrentRawStream", None)
        device = place.gpu_device_id()
        if getter is not None:
            return int(getter(device))
        return int(paddle.device.current_stream(f"gpu:{device}")._as_parameter_.value or 0)
    import torch  # the GPU test suite's provider

    return int(torch.cuda.current_stream(t.device).cuda_stream)
