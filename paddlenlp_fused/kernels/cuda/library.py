"""Loading ``libpaddlenlp_fused_cuda.so`` (built from ``csrc/`` by setup.py) with ctypes.

The library is looked for at ``$PADDLENLP_FUSED_CUDA_LIB`` or ``paddlenlp_fused/_lib/``. Its ABI
version must match ``ABI_VERSION``. It links the CUDA runtime of the nvcc that built it statically,
and that runtime refuses to run on an older driver (every call fails with "insufficient driver"):
``status()`` compares the driver's CUDA version with the runtime's, so the backend reports itself
unavailable with the reason instead of failing at the first launch. Entry points return a status
code; ``check`` turns a non-zero one into an exception naming the op.
"""

from __future__ import annotations

import ctypes
import mmap
import os
import pathlib
import re
from typing import Optional, Tuple

from ...runtime.device import current_stream

ABI_VERSION = 3
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
        _error = f"{path} is not built (install with nvcc on PATH on a machine with a GPU, or with PADDLENLP_FUSED_BUILD_CUDA=1; or set PADDLENLP_FUSED_CUDA_LIB)"
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


def runtime_version(path: pathlib.Path) -> Optional[Tuple[int, int]]:
    """(major, minor) of the CUDA toolkit that built the library (so of the runtime it links), read
    from the release string nvcc embeds in every object; None if absent."""
    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
        match = re.search(rb"Cuda compilation tools, release (\d+)\.(\d+)", data)
        return None if match is None else (int(match.group(1)), int(match.group(2)))


def driver_version() -> Optional[int]:
    """The CUDA version the installed driver supports (1000 * major + 10 * minor), None without one."""
    try:
        libcuda = ctypes.CDLL("libcuda.so.1")
    except OSError:
        return None
    version = ctypes.c_int(0)
    if libcuda.cuDriverGetVersion(ctypes.byref(version)) != 0:
        return None
    return version.value


def driver_problem(runtime: Optional[Tuple[int, int]], driver: Optional[int]) -> Optional[str]:
    """Why a library built with CUDA ``runtime`` cannot run on ``driver``, or None. A runtime runs
    on any driver of its major version or newer (CUDA's minor-version compatibility)."""
    if driver is None:
        return "no NVIDIA driver is installed (libcuda.so.1 not found)"
    if runtime is not None and driver < 1000 * runtime[0]:
        return (f"the NVIDIA driver supports CUDA {driver // 1000}.{driver % 1000 // 10}, but the library is "
                f"built with CUDA {runtime[0]}.{runtime[1]} (needs a driver for CUDA {runtime[0]}.0 or newer): "
                f"update the driver, or rebuild the library with an older nvcc")
    return None


_driver_error: Optional[str] = None
_driver_checked = False


def status() -> Tuple[bool, str]:
    """(available, reason): the library is built, loadable, of our ABI, and the driver can run it."""
    global _driver_error, _driver_checked
    lib, error = load()
    if lib is None:
        return False, error
    if not _driver_checked:
        _driver_error = driver_problem(runtime_version(library_path()), driver_version())
        _driver_checked = True
    if _driver_error:
        return False, _driver_error
    return True, f"CUDA kernel library ABI {lib.pnf_abi_version()}"


def get() -> ctypes.CDLL:
    available, reason = status()
    if not available:
        raise RuntimeError(f"CUDA kernel library unavailable: {reason}")
    return _lib


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
    """The raw CUDA stream that work on ``t`` should use (its framework's current stream)."""
    return current_stream(t)
