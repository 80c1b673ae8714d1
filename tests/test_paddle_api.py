"""The Paddle GPU path pinned without a Paddle GPU build.

Every Paddle attribute that the GPU path (runtime.device, the Triton driver for Paddle, the ops'
buffers) calls exists and accepts the arguments it is called with, on the installed Paddle; CI runs
this file also on the oldest supported Paddle (``.ci/run``: a second environment). Triton's
launcher specialises Paddle tensors exactly as torch tensors (dtype, 16-byte alignment). And the
stream lookup works on a Paddle without ``paddle._C`` (Paddle 3.2; it raised AttributeError). And
``paddle.grad`` of one output of a several-output PyLayer (Paddle 3.2 segfaulted).
"""

import ctypes
import inspect
import signal
import subprocess
import sys
import types

import numpy as np
import paddle
import pytest
import triton.language as tl
from triton.backends.compiler import GPUTarget
from triton.compiler.compiler import make_backend
from triton.runtime.jit import JITFunction, create_function_from_signature

from paddlenlp_fused.kernels.cuda import library
from paddlenlp_fused.ops._pylayer import TritonPyLayer, grads_for, needs_grad
from paddlenlp_fused.runtime import device, versions

GPU = "gpu:0"
# (attribute under paddle, positional and keyword arguments as the GPU path passes them, caller)
CALLS = [
    ("is_compiled_with_cuda", (), {}, "runtime.device.PaddleDevice.is_active, backend.local_device"),
    ("device.cuda.device_count", (), {}, "PaddleDevice.is_active, backend.local_device"),
    ("device.get_device", (), {}, "runtime.device.paddle_current_device"),
    ("device.set_device", (GPU,), {}, "PaddleDevice.set_device"),
    ("device.cuda.get_device_capability", (0,), {}, "PaddleDevice.capability"),
    ("device.synchronize", (), {}, "PaddleDevice.synchronize (do_bench)"),
    ("device.Event", (), {"enable_timing": True}, "PaddleDevice.event (do_bench)"),
    ("device.Event.record", (object(),), {}, "do_bench: event.record()"),
    ("device.Event.elapsed_time", (object(), object()), {}, "do_bench: start.elapsed_time(end)"),
    ("device.current_stream", (GPU,), {}, "runtime.device.paddle_raw_stream without the raw getter"),
    ("empty", ([16],), {"dtype": "int8"}, "PaddleDevice.empty_bytes (Triton's allocator)"),
    ("empty", ([16],), {"dtype": "int32"}, "PaddleDevice.empty_int32 (do_bench's L2 flush)"),
    ("empty", ([16],), {"dtype": "float32", "device": paddle.CPUPlace()}, "ops: buffers on the input's place"),
    ("zeros", ([2],), {"dtype": "int32", "device": paddle.CPUPlace()}, "ops: the norm's counters"),
]


def _resolve(path: str):
    obj = paddle
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def test_installed_paddle_is_in_the_supported_range():
    assert versions.paddle_problem(paddle.__version__) is None, paddle.__version__
    assert versions.parse(paddle.__version__) < versions.PADDLE_SUPPORTED[1] or \
        versions.parse(paddle.__version__) == (0, 0), f"Paddle {paddle.__version__} is newer than the tested range"


@pytest.mark.parametrize("path,args,kwargs,caller", CALLS, ids=[f"{c[0]}{sorted(c[2])}" for c in CALLS])
def test_gpu_path_attribute_exists_with_the_signature_used(path, args, kwargs, caller):
    target = _resolve(path)
    try:
        signature = inspect.signature(target)
    except ValueError:  # a C function without a signature: existence is what can be checked
        assert callable(target), f"paddle.{path} ({caller})"
        return
    signature.bind(*args, **kwargs)  # raises TypeError if the call as written does not fit


def test_cpu_reachable_calls_run():
    """The calls that need no GPU, run: buffers on a place, in-place zeroing, the place queries."""
    t = paddle.empty([16], dtype="float32", device=paddle.CPUPlace())
    z = paddle.zeros([2], dtype="int32", device=t.place)
    assert t.place.is_cpu_place() and not t.place.is_gpu_place() and not z.numpy().any()
    t.zero_()
    assert not t.numpy().any() and isinstance(t.data_ptr(), int)
    assert callable(t.place.gpu_device_id)


def test_raw_stream_sources_exist():
    """Paddle >= 3.3 has the raw stream getter; every supported Paddle has the Stream wrapper's
    address property, which is the fallback."""
    assert isinstance(inspect.getattr_static(paddle.device.Stream, "_as_parameter_"), property)
    has_getter = hasattr(paddle.base.libpaddle, "_get_current_raw_stream")
    assert has_getter == (versions.parse(paddle.__version__) >= (3, 3)) or versions.parse(paddle.__version__) == (0, 0)


class _FakeStream:
    def __init__(self, address):
        self._as_parameter_ = ctypes.c_void_p(address)


def _stand_in_paddle(raw_getter=None):
    """A ``paddle`` with only what runtime.device touches: no ``_C`` (as on Paddle 3.2)."""
    asked = []

    def current_stream(where):
        asked.append(where)
        return _FakeStream(0x5000 + int(where.split(":")[1]))

    libpaddle = types.SimpleNamespace()
    if raw_getter is not None:
        libpaddle._get_current_raw_stream = raw_getter
    fake = types.ModuleType("paddle")
    fake.base = types.SimpleNamespace(libpaddle=libpaddle)
    fake.device = types.SimpleNamespace(current_stream=current_stream, get_device=lambda: "gpu:3")
    return fake, asked


class _GpuTensor:
    """A Paddle GPU tensor as the CUDA launchers see it: a place on GPU 3."""

    place = types.SimpleNamespace(is_gpu_place=lambda: True, gpu_device_id=lambda: 3)


def test_stream_lookup_without_paddle_C(monkeypatch):
    """Regression: the stream lookups called ``getattr(paddle._C, ...)``, an AttributeError on Paddle
    3.2 (no ``paddle._C``), so the fallback to ``paddle.device.current_stream`` never ran."""
    fake, asked = _stand_in_paddle()
    monkeypatch.setitem(sys.modules, "paddle", fake)
    assert not hasattr(fake, "_C")
    assert device.paddle_raw_stream(3) == 0x5003 and asked == ["gpu:3"]
    assert library.stream_of(_GpuTensor()) == 0x5003
    assert device.PaddleDevice.current_stream(device.PaddleDevice.current_device()) == 0x5003


def test_stream_lookup_prefers_the_raw_getter(monkeypatch):
    fake, asked = _stand_in_paddle(raw_getter=lambda index: 0x7000 + index)
    monkeypatch.setitem(sys.modules, "paddle", fake)
    assert library.stream_of(_GpuTensor()) == 0x7003 and not asked


def test_current_device_must_be_a_gpu(monkeypatch):
    fake, _ = _stand_in_paddle()
    fake.device.get_device = lambda: "cpu"
    monkeypatch.setitem(sys.modules, "paddle", fake)
    with pytest.raises(RuntimeError, match="set_device"):
        device.paddle_current_device()


def _kernel(x_ptr, y_ptr, n, BLOCK: tl.constexpr):
    pass


class _TorchStyle:
    """What Triton reads of a torch tensor: ``data_ptr()`` and ``str(dtype)`` ('torch.float16')."""

    class _Dtype:
        def __init__(self, name):
            self.name = name

        def __str__(self):
            return f"torch.{self.name}"

        def __hash__(self):
            return hash(self.name)

        def __eq__(self, other):
            return isinstance(other, type(self)) and other.name == self.name

    def __init__(self, dtype_name, address):
        self.dtype, self.address = self._Dtype(dtype_name), address

    def data_ptr(self):
        return self.address


@pytest.mark.parametrize("capability", [80, 90])
def test_triton_specialises_paddle_tensors_as_torch_tensors(capability):
    """Through the binder Triton 3.6's JITFunction.run builds (create_function_from_signature with
    the CUDA backend): per pointer its element type and whether it is 16-byte aligned."""
    binder = create_function_from_signature(*(lambda k: (k.signature, k.params))(JITFunction(_kernel)),
                                            make_backend(GPUTarget("cuda", capability, 32)))
    expected = {"float32": "*fp32", "float16": "*fp16", "bfloat16": "*bf16", "int32": "*i32", "int8": "*i8",
                "int64": "*i64", "float64": "*fp64", "uint8": "*u8", "bool": "*u1"}
    for name, type_string in expected.items():
        base = paddle.zeros([64], dtype=name)
        aligned, shifted = base, base[1:]  # shifted: one element on, not 16-byte aligned
        assert aligned.data_ptr() % 16 == 0 and shifted.data_ptr() % 16 != 0
        _, got, _ = binder(aligned, shifted, 32, BLOCK=4)
        _, ref, _ = binder(_TorchStyle(name, aligned.data_ptr()), _TorchStyle(name, shifted.data_ptr()), 32, BLOCK=4)
        assert got == ref, (name, got, ref)
        assert got[0] == (type_string, "D") and got[1] == (type_string, ""), (name, got)


class _TwoOutputs(TritonPyLayer):
    """(2x, x + r): the smallest several-output PyLayer on the ops' base class."""

    @staticmethod
    def forward(ctx, x, r):
        ctx.needs_grad = needs_grad(x, r)
        return x * 2.0, x + r

    @staticmethod
    def backward(ctx, dy, dh):
        return grads_for(ctx, [dy * 2.0 + dh, dh])


@pytest.mark.parametrize("how", ["paddle.grad of the first output", "paddle.grad of the second output", "backward"])
def test_grad_of_one_output_of_a_several_output_pylayer(how):
    """Paddle 3.2 segfaulted here (before the backward ran) while filling the other output's gradient
    with zeros; the ops' base class fills it."""
    x, r = paddle.to_tensor([1.0, -2.0, 3.0]), paddle.to_tensor([0.5, 0.5, 0.5])
    x.stop_gradient = r.stop_gradient = False
    y, h = _TwoOutputs.apply(x, r)
    weights = paddle.to_tensor([1.0, 10.0, 100.0])
    if how == "backward":
        (y * weights).sum().backward()
        dx, dr = x.grad, r.grad
    else:
        used = y if how.endswith("first output") else h
        dx, dr = paddle.grad([used], [x, r], [weights])
    expected_dx, expected_dr = ([2.0, 20.0, 200.0], [0.0, 0.0, 0.0]) if how != "paddle.grad of the second output" \
        else ([1.0, 10.0, 100.0], [1.0, 10.0, 100.0])
    assert dx.numpy().tolist() == expected_dx and dr.numpy().tolist() == expected_dr


def test_grad_of_the_norm_output_without_its_residual_stream():
    """The op where the segfault was found: prenorm LayerNorm with a residual on Triton (the
    interpreter here), ``paddle.grad`` of y alone over every input."""
    from paddlenlp_fused.ops.norm import layer_norm_fn

    rng = np.random.default_rng(0)
    inputs = [paddle.to_tensor(rng.standard_normal(shape).astype("float32")) for shape in ((4, 24), (24,), (24,), (4, 24))]
    for t in inputs:
        t.stop_gradient = False
    dy = paddle.to_tensor(rng.standard_normal((4, 24)).astype("float32"))
    grads = {}
    for backend in ("triton", "reference"):
        y, _ = layer_norm_fn(inputs[0], inputs[1], inputs[2], inputs[3], prenorm=True, backend=backend)
        grads[backend] = paddle.grad([y], inputs, [dy])
    for got, want in zip(grads["triton"], grads["reference"]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=1e-5, atol=1e-5)


class _KeepsInputs(TritonPyLayer):
    """x * w, keeping x as a ctx attribute and w through save_for_backward."""

    op = "keeps_inputs"

    @staticmethod
    def forward(ctx, x, w):
        ctx.save_for_backward(w)
        ctx.kept = (x,)
        return x * w

    @staticmethod
    def backward(ctx, dy):
        (w,) = ctx.saved_tensor()
        return dy * w, dy * ctx.kept[0]


@pytest.mark.parametrize("edited", ["x", "w", "neither"])
def test_inplace_edit_of_a_tensor_the_backward_reads_raises(edited):
    """Saved by save_for_backward or kept as a ctx attribute, edited through a view (a reshape shares
    the version): the backward raises Paddle's in-place error naming the op and the input; an edit of
    the output, which the backward does not read, does not raise."""
    x, w = paddle.to_tensor([1.0, 2.0, 3.0, 4.0]), paddle.to_tensor([0.5, 1.5, 2.5, 3.5])
    x.stop_gradient = w.stop_gradient = False
    xs, ws = x * 1.0, w * 1.0
    y = _KeepsInputs.apply(xs, ws)
    if edited == "neither":
        y.scale_(2.0)
        y.sum().backward()
        np.testing.assert_array_equal(x.grad.numpy(), 2.0 * w.numpy())
        return
    {"x": xs, "w": ws}[edited].reshape([2, 2]).scale_(2.0)
    with pytest.raises(OSError, match=rf"\(PermissionDenied\) keeps_inputs: input '{edited}', used in gradient "
                                      r"computation, has been modified by an inplace operation"):
        y.sum().backward()


def test_double_backward_through_a_pylayer_raises():
    x, w = paddle.to_tensor([1.0, 2.0]), paddle.to_tensor([3.0, 4.0])
    x.stop_gradient = w.stop_gradient = False
    with pytest.raises(OSError, match=r"NotImplementedError: keeps_inputs: double backward \(paddle.grad\(\.\.\., "
                                      r"create_graph=True\)\) is not implemented"):
        paddle.grad((_KeepsInputs.apply(x, w) ** 2).sum(), [x, w], create_graph=True)


_SECOND_BACKWARD = """
import paddle
from paddle.autograd import PyLayer

class Double(PyLayer):
    @staticmethod
    def forward(ctx, x):
        return x * 2.0

    @staticmethod
    def backward(ctx, dy):
        print("backward", flush=True)
        return dy * 2.0

x = paddle.ones([3])
x.stop_gradient = False
loss = Double.apply(x * 1.0).sum()
loss.backward(retain_graph=True)
print("first backward done", flush=True)
loss.backward()
print("second backward done", x.grad.numpy().tolist(), flush=True)
"""


def test_a_second_backward_through_a_pylayer_crashes_paddle():
    """Paddle 3.3.1 segfaults in GradNodePyLayer on a second backward over a retained graph, before
    the PyLayer's backward runs (so no base class can turn it into an error); docs/autograd.md gives
    the ways round it. When this fails because the second backward passes (x.grad [4, 4, 4]), Paddle
    fixed it: run the contract's accumulation check with retain_graph, then drop the limit from the
    docs and this test."""
    proc = subprocess.run([sys.executable, "-c", _SECOND_BACKWARD], capture_output=True, text=True, timeout=300)
    assert proc.stdout.count("backward\n") == 1 and "first backward done" in proc.stdout, proc.stdout + proc.stderr[-2000:]
    assert proc.returncode == -signal.SIGSEGV or "Segmentation fault" in proc.stderr, \
        f"rc {proc.returncode}: {proc.stdout}{proc.stderr[-2000:]}"
