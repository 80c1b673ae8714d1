"""GPU tensor providers for ``tests/gpu`` and ``benchmarks``.

The kernels' launchers take any tensor with ``data_ptr()``, ``shape``, ``stride()`` and ``dtype``.
Paddle provides them where a CUDA build of Paddle runs on the device; torch otherwise (the H200
machine has torch and no Paddle build for sm_90). Both expose the same small API.
"""

from __future__ import annotations

import warnings

import numpy as np


class TorchProvider:
    name = "torch"

    def __init__(self):
        import torch

        self.torch = torch
        self.device = torch.device("cuda", torch.cuda.current_device())

    def dtype(self, name: str):
        return getattr(self.torch, name)

    def randn(self, shape, dtype="float32", scale=1.0, offset=0.0):
        t = self.torch.randn(tuple(shape), device=self.device, dtype=self.torch.float32) * scale + offset
        return t.to(self.dtype(dtype))

    def empty(self, shape, dtype="float32"):
        return self.torch.empty(tuple(shape), device=self.device, dtype=self.dtype(dtype))

    def poisoned(self, shape, dtype="float32"):
        """An output buffer full of NaN: any element the kernel fails to write shows up."""
        return self.torch.full(tuple(shape), float("nan"), device=self.device, dtype=self.dtype(dtype))

    def zeros(self, shape, dtype="float32"):
        return self.torch.zeros(tuple(shape), device=self.device, dtype=self.dtype(dtype))

    def from_numpy(self, array, dtype="float32"):
        return self.torch.from_numpy(np.ascontiguousarray(array)).to(self.device).to(self.dtype(dtype))

    def to_numpy(self, t) -> np.ndarray:
        return t.detach().to(self.torch.float64).cpu().numpy()

    def copy_(self, dst, src):
        dst.copy_(src)

    def matmul(self, a, b):
        return self.torch.matmul(a, b)

    def synchronize(self):
        self.torch.cuda.synchronize()

    def reset_peak_memory(self):
        self.synchronize()
        self.torch.cuda.reset_peak_memory_stats()

    def memory_allocated(self) -> int:
        return self.torch.cuda.memory_allocated()

    def peak_memory(self) -> int:
        self.synchronize()
        return self.torch.cuda.max_memory_allocated()

    def device_name(self) -> str:
        return self.torch.cuda.get_device_name()


class PaddleProvider:
    name = "paddle"

    def __init__(self):
        import paddle

        from ..runtime.triton_paddle import install_paddle_driver

        self.paddle = paddle
        paddle.device.set_device("gpu")
        install_paddle_driver()

    def dtype(self, name: str):
        return getattr(self.paddle, name)

    def randn(self, shape, dtype="float32", scale=1.0, offset=0.0):
        return (self.paddle.randn(list(shape), dtype="float32") * scale + offset).astype(dtype)

    def empty(self, shape, dtype="float32"):
        return self.paddle.empty(list(shape), dtype=dtype)

    def poisoned(self, shape, dtype="float32"):
        return self.paddle.full(list(shape), float("nan"), dtype=dtype)

    def zeros(self, shape, dtype="float32"):
        return self.paddle.zeros(list(shape), dtype=dtype)

    def from_numpy(self, array, dtype="float32"):
        return self.paddle.to_tensor(np.ascontiguousarray(array)).astype(dtype)

    def to_numpy(self, t) -> np.ndarray:
        return t.astype("float64").numpy()

    def copy_(self, dst, src):
        self.paddle.assign(src, output=dst)

    def matmul(self, a, b):
        return self.paddle.matmul(a, b)

    def synchronize(self):
        self.paddle.device.synchronize()

    def reset_peak_memory(self):
        self.synchronize()
        self.paddle.device.cuda.reset_max_memory_allocated()

    def memory_allocated(self) -> int:
        return self.paddle.device.cuda.memory_allocated()

    def peak_memory(self) -> int:
        self.synchronize()
        return self.paddle.device.cuda.max_memory_allocated()

    def device_name(self) -> str:
        return self.paddle.device.cuda.get_device_name()


def _paddle_gpu_problem():
    """Why Paddle cannot provide GPU tensors here, or None."""
    try:
        import paddle
    except ImportError:
        return "paddle is not installed"
    if not paddle.is_compiled_with_cuda():
        return f"paddle {paddle.__version__} is a CPU build"
    if paddle.device.cuda.device_count() == 0:
        return "Paddle sees no GPU"
    try:
        x = paddle.ones([4], dtype="float32").cuda()
        if float((x * 2).sum()) != 8.0:
            return "a Paddle GPU kernel computes a wrong result on this device"
    except Exception as exc:  # (a wheel without this GPU's architecture fails here, in Paddle's own error types)
        return f"a Paddle GPU kernel fails on this device ({type(exc).__name__}: {str(exc)[:200]})"
    return None


def _torch_gpu_problem():
    try:
        import torch
    except ImportError:
        return "torch is not installed"
    return None if torch.cuda.is_available() else "torch sees no CUDA device"


def gpu_provider():
    """Paddle when a CUDA build of Paddle runs on the device, torch otherwise; None without a GPU.
    Which one runs, and why the other does not, is in the provider's ``selection`` and is reported
    with a warning (the suites' results depend on it)."""
    paddle_problem = _paddle_gpu_problem()
    if paddle_problem is None:
        provider, selection = PaddleProvider(), "paddle: a CUDA build of Paddle runs on this device"
    else:
        torch_problem = _torch_gpu_problem()
        if torch_problem is not None:
            return None
        provider, selection = TorchProvider(), f"torch, because {paddle_problem}"
    provider.selection = selection
    warnings.warn(f"paddlenlp_fused GPU tensors from {selection}", UserWarning, stacklevel=2)
    return provider
