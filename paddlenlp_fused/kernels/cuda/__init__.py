"""CUDA kernels from ``csrc/`` behind a plain C ABI, loaded with ctypes (``library.py``); one
wrapper module per kernel family passes ``data_ptr()``s, sizes, strides and the current stream."""

from .library import status as library_status  # (available, reason) of the CUDA kernel library
