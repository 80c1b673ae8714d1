"""Triton on Paddle tensors.

On the GPU, Triton's launcher needs only ``data_ptr()`` and ``str(dtype)`` of a tensor; what ties it
to torch is the driver object (current device and stream, capability, benchmarker, L2-flush buffer).
``install_paddle_driver`` registers a subclass of Triton's CUDA driver whose hooks use Paddle, plus an
allocator for kernels that need global scratch, so kernels run on Paddle's current stream. No file
of the installed Triton is edited and no torch is imported.

``triton_args(*tensors)`` is what an op calls before a launcher: it installs the right driver once and
returns the tensors in the form the launcher takes (GPU tensors as they are; CPU tensors wrapped for
the interpreter).
"""

from __future__ import annotations

from .backend import interpreter_enabled
from .interpreter import install_interpreter_driver, wrap
from .tensor import device_kind

_paddle_driver_installed = False


class _PaddleDeviceInterface:
    """The part of ``torch.cuda`` that ``triton.testing.do_bench`` uses."""

    @staticmethod
    def synchronize():
        import paddle

        paddle.device.synchronize()

    @staticmethod
    def Event(enable_timing: bool = False):
        import paddle

        return paddle.device.Event(enable_timing=enable_timing)


def _current_raw_stream(device: int) -> int:
    import paddle

    getter = getattr(paddle._C, "_cuda_getCurrentRawStream", None)  # Paddle >= 3.2
    if getter is not None:
        return getter(device)
    return paddle.device.current_stream(f"gpu:{device}")._as_parameter_.value or 0


def install_paddle_driver() -> None:
    """Make Triton launch on Paddle's current device and stream (idempotent)."""
    global _paddle_driver_installed
    if _paddle_driver_installed:
        return
    import paddle
    import triton
    from triton.backends.nvidia.driver import CudaDriver, CudaLauncher, CudaUtils
    from triton.runtime import driver

    class PaddleCudaDriver(CudaDriver):
        def __init__(self):  # CudaDriver.__init__ would import torch
            self.utils = CudaUtils()
            self.launcher_cls = CudaLauncher

        def get_current_device(self):
            return int(paddle.device.get_device().split(":")[-1])

        def set_current_device(self, device):
            paddle.device.set_device(f"gpu:{device}")

        def get_current_stream(self, device=None):
            return _current_raw_stream(self.get_current_device() if device is None else device)

        def get_device_capability(self, device=None):
            return paddle.device.cuda.get_device_capability(device)

        def get_active_torch_device(self):
            return None

        def get_device_interface(self):
            return _PaddleDeviceInterface

        def get_empty_cache_for_benchmark(self):
            return paddle.empty([64 * 1024 * 1024], dtype="int32")  # 256 MB, past the L2

        def clear_cache(self, cache):
            cache.zero_()

        @staticmethod
        def is_active():
            return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0

    driver.set_active(PaddleCudaDriver())
    triton.set_allocator(lambda size, alignment, stream: paddle.empty([size], dtype="int8"))
    _paddle_driver_installed = True


def triton_args(*tensors):
    """The tensors as a Triton launcher takes them; installs the matching driver on first use."""
    present = [t for t in tensors if t is not None]
    on_gpu = {device_kind(t) == "gpu" for t in present}
    if len(on_gpu) > 1:
        raise ValueError("tensors: all inputs of one op must be on the same device (got CPU and GPU)")
    if on_gpu == {True}:
        install_paddle_driver()
        return tensors
    if not interpreter_enabled():
        raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before importing paddlenlp_fused")
    install_interpreter_driver()
    return tuple(wrap(t) for t in tensors)
