"""The Triton driver for Paddle (runtime.triton_paddle) on the GPU, with no Paddle build here: the
few device calls it makes (runtime.device.PaddleDevice's methods) are answered by a torch-backed
stand-in, so everything else of the driver runs as it does under Paddle. Kernels launched through
it must run on the current, non-default stream, after the work queued there before them, on the
first (compiling) and later (direct) launches; ``triton.testing.do_bench`` must time through it; and
leaving its scope must give Triton its own driver back for torch kernels.
"""

import numpy as np
import pytest
import triton

from paddlenlp_fused.kernels.triton import norm as triton_norm
from paddlenlp_fused.runtime import triton_paddle
from paddlenlp_fused.runtime.device import PaddleDevice
from paddlenlp_fused.testing.numerics import assert_close

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("no CUDA device", allow_module_level=True)


class TorchDevice:
    """PaddleDevice's methods, answered by torch (what Paddle answers on a Paddle GPU build)."""

    def __init__(self):
        self.calls = []

    def current_device(self):
        return torch.cuda.current_device()

    def set_device(self, device):
        torch.cuda.set_device(device)

    def current_stream(self, device):
        self.calls.append("current_stream")
        return torch.cuda.current_stream(device).cuda_stream

    def capability(self, device):
        return torch.cuda.get_device_capability(device)

    def synchronize(self):
        torch.cuda.synchronize()

    def event(self, enable_timing=False):
        return torch.cuda.Event(enable_timing=enable_timing)

    def empty_bytes(self, size):
        return torch.empty(size, dtype=torch.int8, device="cuda")

    def empty_int32(self, count):
        return torch.empty(count, dtype=torch.int32, device="cuda")

    def is_active(self):
        return torch.cuda.is_available()


def test_stand_in_has_every_method_of_paddle_device():
    wanted = {name for name in vars(PaddleDevice) if not name.startswith("_")}
    assert wanted <= {name for name in dir(TorchDevice) if not name.startswith("_")}


def _layer_norm_on(x_src, M, N):
    """LayerNorm forward of x, where x is written on the current stream after a long sleep."""
    x = torch.empty((M, N), device="cuda", dtype=torch.float32)
    torch.cuda._sleep(50_000_000)  # tens of ms of queued work: a kernel on another stream overtakes it
    x.copy_(x_src)
    w, b = torch.ones(N, device="cuda"), torch.zeros(N, device="cuda")
    y = torch.full((M, N), float("nan"), device="cuda")
    mean, rstd = torch.empty(M, device="cuda"), torch.empty(M, device="cuda")
    triton_norm.norm_fwd(x, w, b, y, mean, rstd)
    return y


def test_kernels_run_on_the_current_stream_in_order():
    api = TorchDevice()
    M, N = 256, 1024
    side = torch.cuda.Stream()
    assert side.cuda_stream != torch.cuda.default_stream().cuda_stream
    with triton_paddle.paddle_triton_driver(api) as driver:
        assert triton.runtime.driver.active is driver
        for launch in range(3):  # first launch compiles (Triton's path), later ones go direct
            src = torch.randn((M, N), device="cuda")
            src_host = src.double().cpu().numpy()
            torch.cuda.synchronize()
            with torch.cuda.stream(side):
                api.calls.clear()
                y = _layer_norm_on(src, M, N)
                assert "current_stream" in api.calls, "the launch did not ask the driver for the stream"
                side.synchronize()
            ref = (src_host - src_host.mean(-1, keepdims=True)) / np.sqrt(src_host.var(-1, keepdims=True) + 1e-5)
            assert_close(f"y (launch {launch})", y.double().cpu().numpy(), ref, "float32")


def test_do_bench_through_the_driver():
    M, N = 4096, 4096
    x, w, b = torch.randn((M, N), device="cuda"), torch.randn(N, device="cuda"), torch.randn(N, device="cuda")
    y, mean, rstd = torch.empty_like(x), torch.empty(M, device="cuda"), torch.empty(M, device="cuda")
    with triton_paddle.paddle_triton_driver(TorchDevice()):
        ms = triton.testing.do_bench(lambda: triton_norm.norm_fwd(x, w, b, y, mean, rstd), warmup=5, rep=20)
    assert 0 < ms < 100, ms


def test_leaving_the_scope_restores_triton_s_driver():
    before = triton.runtime.driver.active  # torch's CUDA driver (the GPU suite's default)
    with triton_paddle.paddle_triton_driver(TorchDevice()) as driver:
        assert triton.runtime.driver.active is driver
    assert triton.runtime.driver.active is before
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # a torch kernel now takes torch's current stream from Triton's driver
        assert triton.runtime.driver.active.get_current_stream(torch.cuda.current_device()) == side.cuda_stream
        src = torch.randn((64, 512), device="cuda")
        y = _layer_norm_on(src, 64, 512)
        side.synchronize()
    s = src.double().cpu().numpy()
    ref = (s - s.mean(-1, keepdims=True)) / np.sqrt(s.var(-1, keepdims=True) + 1e-5)
    assert_close("y after restore", y.double().cpu().numpy(), ref, "float32")
