"""CUDA kernels from ``csrc/`` behind a plain C ABI, loaded with ctypes (``library.py``); one
wrapper module per kernel family passes ``data_ptr()``s, sizes, strides and the current stream."""

from .library import load


def library_status():
    """(available, reason) of the CUDA kernel library."""
    lib, error = load()
    if lib is None:
        return False, error
    return True, f"CUDA kernel library ABI {lib.pnf_abi_version()}"
