"""CUDA kernels from ``csrc/`` behind a plain C ABI, loaded with ctypes."""


def library_status():
    """(available, reason) of the CUDA kernel library."""
    return False, "no CUDA kernel library is part of this build yet (csrc/ has no kernels)"
