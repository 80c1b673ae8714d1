"""The current CUDA device, stream and compute capability: the one place that asks a framework.

Kernel launchers (``kernels/``, which import no paddle) take the stream of a tensor from
``current_stream(t)``: Paddle's current stream for a Paddle tensor, torch's for a torch tensor (the
GPU suite's provider). ``PaddleDevice`` is what the Triton driver for Paddle calls; every Paddle
attribute it touches exists with these signatures on each Paddle of ``versions.PADDLE_SUPPORTED``
(tests/test_paddle_api.py checks them on the oldest and the newest).

Paddle >= 3.3 has the raw current stream as ``paddle.base.libpaddle._get_current_raw_stream``
(re-exported as ``paddle._C._cuda_getCurrentRawStream``); 3.2 has neither ``paddle._C`` nor that
function, only ``paddle.device.current_stream(...)``, a Python wrapper (slower to build) whose
``_as_parameter_`` holds the address.
"""

from __future__ import annotations


def _paddle():
    import paddle

    return paddle


def paddle_raw_stream(device: int) -> int:
    """Address of Paddle's current CUDA stream on GPU ``device``."""
    paddle = _paddle()
    getter = getattr(paddle.base.libpaddle, "_get_current_raw_stream", None)  # Paddle >= 3.3
    if getter is not None:
        return int(getter(device))
    return int(paddle.device.current_stream(f"gpu:{device}")._as_parameter_.value or 0)


def paddle_current_device() -> int:
    """Index of Paddle's current GPU."""
    where = _paddle().device.get_device()
    kind, _, index = where.partition(":")
    if kind != "gpu" or not index.isdigit():
        raise RuntimeError(f"Paddle's current device is {where!r}: Triton GPU kernels need a 'gpu:N' device "
                           f"(paddle.device.set_device('gpu'))")
    return int(index)


class PaddleDevice:
    """The device calls of Triton's driver, answered by Paddle. The GPU suite substitutes a
    torch-backed object with the same methods to drive ``runtime.triton_paddle``'s driver."""

    @staticmethod
    def current_device() -> int:
        return paddle_current_device()

    @staticmethod
    def set_device(device: int) -> None:
        _paddle().device.set_device(f"gpu:{device}")

    @staticmethod
    def current_stream(device: int) -> int:
        return paddle_raw_stream(device)

    @staticmethod
    def capability(device: int):
        return tuple(_paddle().device.cuda.get_device_capability(device))

    @staticmethod
    def synchronize() -> None:
        _paddle().device.synchronize()

    @staticmethod
    def event(enable_timing: bool = False):
        return _paddle().device.Event(enable_timing=enable_timing)

    @staticmethod
    def empty_bytes(size: int):
        """A device buffer of ``size`` bytes on the current GPU (Triton's scratch allocator)."""
        return _paddle().empty([size], dtype="int8")

    @staticmethod
    def empty_int32(count: int):
        return _paddle().empty([count], dtype="int32")

    @staticmethod
    def is_active() -> bool:
        paddle = _paddle()
        return paddle.is_compiled_with_cuda() and paddle.device.cuda.device_count() > 0


def current_stream(t) -> int:
    """The raw CUDA stream that work on GPU tensor ``t`` should use: Paddle's or torch's current one."""
    place = getattr(t, "place", None)
    if place is not None:  # Paddle
        if not place.is_gpu_place():
            raise ValueError(f"expected a GPU tensor, got one on {place}")
        return paddle_raw_stream(place.gpu_device_id())
    import torch  # the GPU suite's provider

    return int(torch.cuda.current_stream(t.device).cuda_stream)
