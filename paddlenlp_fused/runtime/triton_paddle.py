"""Triton on Paddle tensors.

On the GPU, Triton's launcher needs only ``data_ptr()`` and ``str(dtype)`` of a tensor; what ties it
to torch is the driver object (current device and stream, capability, benchmarker, L2-flush buffer).
``make_driver`` builds a subclass of Triton's CUDA driver whose hooks ask ``runtime.device``
(Paddle), plus an allocator for kernels that need global scratch, so kernels run on Paddle's current
stream. No file of the installed Triton is edited and no torch is imported.

``triton_args(*tensors)`` is what an op calls before a launcher: it makes the right driver active
(ours on the GPU, the interpreter's on the CPU) and returns the tensors in the form the launcher
takes (GPU tensors as they are; CPU tensors wrapped for the interpreter).

Triton's active driver is process-wide and its allocator a context variable, so what an op left
there a torch Triton kernel launched later in the process would use. Ops therefore launch inside a
scope: ``triton_scoped`` (on each public op, on each PyLayer's forward and backward through
``ops._pylayer.TritonPyLayer``, on the optimizer step) counts the scoped calls in progress,
``triton_args`` records what was active when it first switches, and when the outermost scoped call
ends, returning or raising, that driver and allocator are active again. Per op call that is a
counter and, where Triton ran, a few assignments: Triton 3.6 asks ``driver.active`` at every launch
for the device, stream and target and keeps nothing of it (a compiled kernel keeps its launcher
class and an autotuner its benchmarker, both the same for torch's CUDA driver and ours), so
switching back and forth is safe. Outside any scope (a benchmark or a test calling a kernel
directly) ``triton_args`` leaves the driver active until ``restore_triton_driver()``;
``paddle_triton_driver()`` is a scope as a ``with`` block.
"""

from __future__ import annotations

import contextlib
import functools

from .backend import interpreter_enabled
from .device import PaddleDevice
from .interpreter import interpreter_driver, wrap
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
            # for kernels that need global scratch; one object, so that activating twice is a no-op
            self.scratch_allocator = lambda size, alignment, stream: api.empty_bytes(size)

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


_driver_config = _allocator_var = None
_gpu_driver = None  # what triton_args activates for GPU tensors (made from PaddleDevice on first use)
_open_scopes = 0  # scoped calls in progress (process-wide, as Triton's driver); nested op calls each count one
_restore = None  # (driver, allocator) to make active again when the outermost scope ends
_previous = None  # (driver, allocator) that the last switch outside a scope replaced


def _triton_state():
    """Triton's driver config and allocator variable (imported on first use: the package imports
    without Triton)."""
    global _driver_config, _allocator_var
    if _driver_config is None:
        from triton.runtime import _allocation, driver

        _driver_config, _allocator_var = driver, _allocation._allocator
    return _driver_config, _allocator_var


def _paddle_driver():
    global _gpu_driver
    if _gpu_driver is None:
        _gpu_driver = make_driver()
    return _gpu_driver


def _activate(target, allocator=None) -> None:
    """Make ``target`` (and ``allocator``, unless None) Triton's active driver, remembering what was
    active: for the outermost open scope to restore, or outside one for ``restore_triton_driver()``."""
    global _restore, _previous
    config, allocator_var = _triton_state()
    active_allocator = allocator_var.get()
    if config._active is target and allocator in (None, active_allocator):
        return
    if _open_scopes:
        if _restore is None:
            _restore = (config._active, active_allocator)
    else:
        _previous = (config._active, active_allocator)
    config._active = target
    if allocator is not None:
        allocator_var.set(allocator)


def _end_scope() -> None:
    global _open_scopes, _restore
    _open_scopes -= 1
    if _open_scopes == 0 and _restore is not None:
        # an active driver of None makes Triton pick its default again on next use (torch's)
        (_driver_config._active, allocator), _restore = _restore, None
        _allocator_var.set(allocator)


def triton_scoped(fn):
    """``fn`` as a scope for the Triton launches it makes (through ``triton_args``): when the
    outermost scoped call returns or raises, Triton's driver and allocator from before it are active
    again; a scoped call inside another restores nothing."""

    @functools.wraps(fn)
    def scoped(*args, **kwargs):
        global _open_scopes
        _open_scopes += 1
        try:
            return fn(*args, **kwargs)
        finally:
            _end_scope()

    return scoped


@contextlib.contextmanager
def paddle_triton_driver(api=None):
    """A scope as a ``with`` block whose Triton launches (direct ones too) use Paddle's device and
    stream, or ``api``'s (the GPU suite's torch-backed stand-in for ``PaddleDevice``, which ops
    inside the block use too). Yields the driver."""
    global _open_scopes, _gpu_driver
    outer_gpu_driver = _gpu_driver
    if api is not None:
        _gpu_driver = make_driver(api)
    _open_scopes += 1
    try:
        install_paddle_driver()
        yield _gpu_driver
    finally:
        if api is not None:
            _gpu_driver = outer_gpu_driver
        _end_scope()


def install_paddle_driver() -> None:
    """Make Triton launch on Paddle's current device and stream: inside a scope until it ends,
    outside one until ``restore_triton_driver()`` (what a benchmark or a test calling kernels
    directly does)."""
    active = _paddle_driver()
    _activate(active, active.scratch_allocator)


def restore_triton_driver() -> None:
    """Give Triton back the driver and allocator that the last switch outside a scope replaced."""
    global _previous
    if _previous is None:
        return
    (_driver_config._active, allocator), _previous = _previous, None
    _allocator_var.set(allocator)


def triton_args(*tensors):
    """The tensors as a Triton launcher takes them; makes the matching driver active (see the
    module docstring for how long)."""
    present = [t for t in tensors if t is not None]
    on_gpu = {device_kind(t) == "gpu" for t in present}
    if len(on_gpu) > 1:
        raise ValueError("tensors: all inputs of one op must be on the same device (got CPU and GPU)")
    if on_gpu == {True}:
        install_paddle_driver()
        return tensors
    if not interpreter_enabled():
        raise RuntimeError("Triton on CPU tensors needs TRITON_INTERPRET=1 set before importing paddlenlp_fused")
    _activate(interpreter_driver())
    return tuple(wrap(t) for t in tensors)
