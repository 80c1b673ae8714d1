"""Triton on Paddle tensors.

On the GPU, Triton's launcher needs only ``data_ptr()`` and ``str(dtype)`` of a tensor; what ties it
to torch is the driver object (current device and stream, capability, benchmarker, L2-flush buffer).
``install_paddle_driver`` registers a subclass of Triton's CUDA driver whose hooks ask
``runtime.device`` (Paddle), plus an allocator for kernels that need global scratch, so kernels run
on Paddle's current stream. No file of the installed Triton is edited and no torch is imported.
``paddle_triton_driver()`` scopes it, restoring the previous driver (torch's) on exit.

``triton_args(*tensors)`` is what an op calls before a launcher: it installs the right driver once and
returns the tensors in the form the launcher takes (GPU tensors as they are; CPU tensors wrapped for
the interpreter).
"""

from __future__ import annotations

import contextlib

from .backend import interpreter_enabled
from .device import PaddleDevice
from .interpreter import install_interpreter_driver, wrap
from .tensor import device_kind

def _device_interface(api):
    """The part of ``torch.cuda`` that ``triton.testing.do_bench`` uses, on ``api``."""

    class DeviceInterface:
        synchronize = staticmethod(api.synchronize)

        @staticmethod
        def Event(enable_timing: bool = False):
            return api.event(enable_timing)

    return DeviceInterface


def make_driver(api=None):
    """A Triton CUDA driver whose device, stream, capability, timing and scratch buffers come from
    ``api`` (default ``runtime.device.PaddleDevice``; the GPU suite passes a torch-backed stand-in)."""
    from triton.backends.nvidia.driver import CudaDriver, CudaLauncher, CudaUtils

    api = api or PaddleDevice()

    class PaddleCudaDriver(CudaDriver):
        def __init__(self):  # CudaDriver.__init__ would import torch
            self.utils = CudaUtils()
            self.launcher_cls = CudaLauncher
            self.api = api

        def get_current_device(self):
            return api.current_device()

        def set_current_device(self, device):
            api.set_device(device)

        def get_current_stream(self, device=None):
            return api.current_stream(api.current_device() if device is None else device)

        def get_device_capability(self, device=None):
            return api.capability(api.current_device() if device is None else device)

        def get_active_torch_device(self):
            return None

        def get_device_interface(self):
            return _device_interface(api)

        def get_empty_cache_for_benchmark(self):
            return api.empty_int32(64 * 1024 * 1024)  # 256 MB, past the L2

        def clear_cache(self, cache):
            cache.zero_()

        @staticmethod
        def is_active():
            return api.is_active()

    return PaddleCudaDriver()


_paddle_driver = None
_previous = None  # (driver, allocator) that were active before install_paddle_driver


def install_paddle_driver(api=None) -> None:
    """Make Triton launch on Paddle's current device and stream (idempotent). Triton's active
    driver and allocator are process-wide: ``restore_triton_driver()`` (or the
    ``paddle_triton_driver()`` scope) gives Triton kernels on torch tensors in the same process
    their own back."""
    global _paddle_driver, _previous
    import triton
    from triton.runtime import _allocation, driver

    if _paddle_driver is None or (api is not None and _paddle_driver.api is not api):
        _paddle_driver = make_driver(api)
    if driver._active is _paddle_driver:
        return
    _previous = (driver._active, _allocation._allocator.get())
    driver.set_active(_paddle_driver)
    device_api = _paddle_driver.api
    triton.set_allocator(lambda size, alignment, stream: device_api.empty_bytes(size))


def restore_triton_driver() -> None:
    """Give Triton back the driver and allocator it had before ``install_paddle_driver``."""
    global _previous
    if _previous is None:
        return
    import triton
    from triton.runtime import driver

    active, allocator = _previous
    _previous = None
    driver._active = active  # None: Triton picks its default driver again on next use (torch's)
    triton.set_allocator(allocator)


@contextlib.contextmanager
def paddle_triton_driver(api=None):
    """Triton launches inside the block use Paddle's (or ``api``'s) device and stream; the driver
    and allocator active before are restored on exit."""
    from triton.runtime import driver

    outer = driver._active is _paddle_driver and _paddle_driver is not None
    install_paddle_driver(api)
    try:
        yield _paddle_driver
    finally:
        if not outer:
            restore_triton_driver()


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
