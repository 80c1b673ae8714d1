"""Triton's interpreter on Paddle CPU tensors.

With ``TRITON_INTERPRET=1`` Triton runs kernels on the CPU with numpy, dereferencing ``data_ptr()``
directly. Before each launch its grid executor asks every tensor argument for torch's storage
protocol (``untyped_storage()``, ``new_empty``, ``set_``, ``size()``, ``stride()``,
``storage_offset()``) to make host copies; for CPU memory those copies are the memory itself.
``InterpreterTensor`` presents a Paddle CPU tensor that way, sharing its memory (no copy), so the
real kernels run on Paddle tensors with no torch installed.

``@triton.autotune`` with several configs asks the active driver for a benchmarker; with no GPU there
is no driver, so ``interpreter_driver()`` is one that runs each config once (every config is
exercised) and reports equal times (the first config wins, deterministically); like the GPU driver,
it is active only while an op runs (``runtime.triton_paddle``).
"""

from __future__ import annotations

from . import tensor as _tensor


class _HostStorage:
    """The memory a tensor views, from its first element; already on the host."""

    def __init__(self, ptr: int):
        self._ptr = ptr

    def data_ptr(self) -> int:
        return self._ptr

    def cpu(self) -> "_HostStorage":
        return self

    def copy_(self, other: "_HostStorage") -> None:
        if other.data_ptr() != self._ptr:  # the interpreter copies host storage back onto itself
            raise RuntimeError("interpreter storage copy between distinct buffers is not supported")


class InterpreterTensor:
    """A Paddle CPU tensor as Triton's interpreter wants a tensor argument (memory shared)."""

    def __init__(self, t, storage: _HostStorage | None = None, offset: int = 0, dims=None, stride=None):
        self.base = t  # keeps the Paddle tensor (and so its memory) alive
        self.dtype = t.dtype
        self.shape = tuple(dims) if dims is not None else _tensor.shape(t)
        self._stride = tuple(stride) if stride is not None else _tensor.strides(t)
        self._storage = storage if storage is not None else _HostStorage(t.data_ptr())
        self._offset = offset

    # torch's storage protocol, as far as the interpreter uses it
    def data_ptr(self) -> int:
        return self._storage.data_ptr() + self._offset * _tensor.itemsize(self.dtype)

    def untyped_storage(self) -> _HostStorage:
        return self._storage

    def storage_offset(self) -> int:
        return self._offset

    def size(self, dim: int | None = None):
        return self.shape if dim is None else self.shape[dim]

    def stride(self, dim: int | None = None):
        return self._stride if dim is None else self._stride[dim]

    def numel(self) -> int:
        return _tensor.numel(self)

    def element_size(self) -> int:
        return _tensor.itemsize(self.dtype)

    def new_empty(self, *_, **__) -> "InterpreterTensor":
        return InterpreterTensor(self.base, self._storage, self._offset, self.shape, self._stride)

    def set_(self, storage: _HostStorage, offset: int, dims, stride) -> "InterpreterTensor":
        self._storage, self._offset = storage, int(offset)
        self.shape, self._stride = tuple(dims), tuple(stride)
        return self

    # what autotune's reset_to_zero / restore_value hooks call
    def zero_(self) -> "InterpreterTensor":
        self.base.zero_()
        return self

    def clone(self) -> "InterpreterTensor":
        return InterpreterTensor(self.base.clone())

    def copy_(self, other: "InterpreterTensor") -> "InterpreterTensor":
        self.base.copy_(other.base, False)
        return self

    def __repr__(self) -> str:
        return f"InterpreterTensor({list(self.shape)}, {self.dtype})"


def wrap(t):
    """A Paddle CPU tensor as an interpreter argument; None passes through."""
    if t is None or isinstance(t, InterpreterTensor):
        return t
    return InterpreterTensor(t)


def _run_once(kernel_call, quantiles=None, **_):
    kernel_call()
    return [1.0, 1.0, 1.0] if quantiles else 1.0


_interpreter_driver = None


def interpreter_driver():
    """The benchmarker-only driver that ``triton_args`` makes active for CPU tensors (made on first
    use). Only for interpreter mode."""
    global _interpreter_driver
    if _interpreter_driver is not None:
        return _interpreter_driver
    from triton.backends.driver import DriverBase

    class InterpreterDriver(DriverBase):
        @classmethod
        def is_active(cls):
            return False

        def map_python_to_cpp_type(self, ty):
            raise NotImplementedError("the interpreter driver compiles nothing")

        def get_current_target(self):
            raise NotImplementedError("the interpreter driver compiles nothing")

        def get_active_torch_device(self):
            return None

        def get_benchmarker(self):
            return _run_once

    _interpreter_driver = InterpreterDriver()
    return _interpreter_driver
