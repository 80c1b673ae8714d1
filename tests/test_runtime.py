"""Backend dispatch, the interpreter adapter (incl. autotune), cheap imports."""

import os
import subprocess
import sys
import warnings

import numpy as np
import paddle
import pytest
import triton
import triton.language as tl

import paddlenlp_fused
from paddlenlp_fused.runtime import backend as B
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.ops import swiglu
from helpers import randn


def test_use_backend_and_env_default(monkeypatch):
    assert paddlenlp_fused.default_backend() == "auto"
    monkeypatch.setenv("PADDLENLP_FUSED_BACKEND", "reference")
    assert paddlenlp_fused.default_backend() == "reference"
    with paddlenlp_fused.use_backend("triton"):
        assert paddlenlp_fused.default_backend() == "triton"
        with paddlenlp_fused.use_backend("auto"):
            assert paddlenlp_fused.default_backend() == "auto"
    assert paddlenlp_fused.default_backend() == "reference"
    monkeypatch.setenv("PADDLENLP_FUSED_BACKEND", "tpu")
    with pytest.raises(ValueError, match="PADDLENLP_FUSED_BACKEND"):
        paddlenlp_fused.default_backend()
    with pytest.raises(ValueError, match="use_backend"):
        with paddlenlp_fused.use_backend("fast"):
            pass


@pytest.mark.parametrize("reentrant", [True, False])
def test_recompute_reruns_the_forward_on_its_use_backend_backend(monkeypatch, reentrant):
    """fleet's recompute re-runs the forward in the backward, after the use_backend block closed: the
    re-run sees the forward's choice, through fleet's custom recompute state, composed with another
    state registered before and with one registered after (fleet's manager alone asserts there)."""
    from paddle.distributed.fleet.recompute.recompute import custom_state_manager as manager
    from paddle.distributed.fleet.utils import recompute

    for attribute in ("custom_get_state_func", "custom_set_state_func"):
        monkeypatch.setattr(manager, attribute, None)
        setter = "set_" + attribute  # (fleet's own, as before any use_backend of this process)
        monkeypatch.setattr(manager, setter, getattr(type(manager), setter).__get__(manager))
    monkeypatch.setattr(B, "_recompute_carries", False)
    states = {"before": "forward", "after": None}
    manager.set_custom_get_state_func(lambda: states["before"])  # registered before ours
    manager.set_custom_set_state_func(lambda state: states.update(before=state))
    seen = []

    def block(t):
        seen.append((paddlenlp_fused.default_backend(), dict(states)))
        return t * t  # (its backward reads t: the non-reentrant recompute re-runs it)

    x = paddle.ones([3])
    x.stop_gradient = False
    for registered_after in (False, True):
        if registered_after:  # fleet's manager alone asserts on a second registration
            manager.set_custom_get_state_func(lambda: states["after"])
            manager.set_custom_set_state_func(lambda state: states.update(after=state))
        seen.clear()
        states.update(before="forward", after="forward" if registered_after else None)
        with paddlenlp_fused.use_backend("reference"):
            y = recompute(block, x * 1.0, use_reentrant=reentrant)
        states.update(before="backward", after="backward" if registered_after else None)
        y.sum().backward()
        assert seen[1:] == seen[:1] and seen[0][0] == "reference", seen  # the re-run saw the forward's
        assert paddlenlp_fused.default_backend() == "auto"  # and all is restored after it
        assert states == {"before": "backward", "after": "backward" if registered_after else None}, states
        np.testing.assert_array_equal(x.grad.numpy(), 2.0 * np.ones(3) * (1 + registered_after))


def test_auto_on_cpu_picks_triton_in_interpreter_mode_else_reference(monkeypatch):
    impl = ("triton", "reference")
    assert B.resolve_backend("op", "auto", "cpu", impl) == "triton"
    with paddlenlp_fused.use_backend("reference"):
        assert B.resolve_backend("op", "auto", "cpu", impl) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setattr(B, "_interpret_mode", False)  # (the mode is decided once per process)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # CPU fallback to the reference is the normal path: no warning
        assert B.resolve_backend("op", "auto", "cpu", impl) == "reference"
    with pytest.raises(B.BackendUnavailableError, match="TRITON_INTERPRET=1"):
        B.resolve_backend("op", "triton", "cpu", impl)


def test_explicit_backend_errors_name_what_is_missing():
    with pytest.raises(B.BackendUnavailableError, match="needs GPU tensors"):
        B.resolve_backend("op", "cuda", "cpu", ("cuda", "triton", "reference"))
    with pytest.raises(B.BackendUnavailableError, match="no 'cuda' implementation"):
        B.resolve_backend("op", "cuda", "cpu", ("triton", "reference"))
    with pytest.raises(B.BackendUnavailableError, match="width 7"):
        B.resolve_backend("op", "triton", "cpu", ("triton", "reference"), unsupported=lambda n: "width 7")


def test_auto_fallback_on_gpu_warns_once(monkeypatch):
    statuses = {"cuda": B.BackendStatus(False, "library not built"), "triton": B.BackendStatus(True, "ok"),
                "reference": B.BackendStatus(True, "ok")}
    monkeypatch.setattr(B, "backend_status", lambda name, device: statuses[name])
    with pytest.warns(RuntimeWarning, match="falling back to the triton backend .*library not built"):
        assert B.resolve_backend("fallback_op", "auto", "gpu", ("cuda", "triton", "reference")) == "triton"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert B.resolve_backend("fallback_op", "auto", "gpu", ("cuda", "triton", "reference")) == "triton"


def test_available_backends_reports_reasons():
    status = paddlenlp_fused.available_backends("cpu")
    assert status["reference"].available
    assert status["triton"].available and "interpreter" in status["triton"].reason
    assert not status["cuda"].available and status["cuda"].reason


def test_op_backend_choice_changes_the_path():
    x = randn((3, 8))
    with paddlenlp_fused.use_backend("reference"):
        ref = swiglu(x)
    np.testing.assert_allclose(swiglu(x).numpy(), ref.numpy(), rtol=1e-6, atol=1e-6)


@triton.autotune(configs=[triton.Config({"BLOCK": 4}), triton.Config({"BLOCK": 16})], key=["n"])
@triton.jit
def _scale_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(out_ptr + offs, tl.load(x_ptr + offs, mask=mask) * 3.0, mask=mask)


def test_autotuned_kernel_runs_in_interpreter_on_paddle_tensors():
    x = randn((37,))
    out = paddle.full([37], float("nan"))
    xa, outa = triton_args(x, out)
    _scale_kernel[lambda meta: (triton.cdiv(37, meta["BLOCK"]),)](xa, outa, 37)
    np.testing.assert_allclose(out.numpy(), 3 * x.numpy(), rtol=1e-6)
    assert _scale_kernel.best_config.kwargs["BLOCK"] in (4, 16)


def test_import_is_cheap_and_kernels_need_no_paddle():
    code = ("import sys, paddlenlp_fused; assert 'paddle' not in sys.modules; "
            "import paddlenlp_fused.kernels.triton.gated_activation; assert 'paddle' not in sys.modules; "
            "assert 'torch' not in sys.modules; print(sorted(paddlenlp_fused.__all__)[:1])")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)


@triton.jit
def _row_sum_kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(0, n, BLOCK):  # a run-time loop bound (needs numpy < 2.4 in the interpreter)
        offs = start + tl.arange(0, BLOCK)
        acc += tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    tl.store(out_ptr, tl.sum(acc, axis=0))


def test_interpreter_runs_loops_with_run_time_bounds():
    x = randn((37,))
    out = paddle.full([1], float("nan"))
    _row_sum_kernel[(1,)](*triton_args(x, out), 37, BLOCK=8)
    np.testing.assert_allclose(out.numpy(), [x.numpy().sum()], rtol=1e-5)


@triton.jit
def _to_bf16_kernel(x_ptr, cast_ptr, stored_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(cast_ptr + offs, x.to(tl.bfloat16), mask=offs < n)  # an explicit cast
    tl.store(stored_ptr + offs, x, mask=offs < n)  # the store's own cast to the pointer's type


def test_interpreter_rounds_bf16_casts_to_nearest_even():
    """Once the kernels' interpreter_compat is imported, fp32 -> bf16 in the interpreter equals
    Paddle's CPU cast (round to nearest even) bit for bit: ties both ways, overflow to inf,
    subnormals, signed zero, inf; NaN stays NaN."""
    import paddlenlp_fused.kernels.triton.interpreter_compat  # noqa: F401

    special = np.array([0x3F808000, 0x3F818000, 0xBF808000, 0x3F80FFFF, 0x7F7FFFFF, 0x00008000, 0x00018001,
                        0x80000000, 0x7F800000, 0xFF800000], dtype=np.uint32).view(np.float32)
    values = np.concatenate([special, np.random.randn(500).astype(np.float32) * 10.0 ** np.random.randint(-30, 30, 500)])
    x = paddle.to_tensor(values.astype(np.float32))
    with_nan = paddle.concat([x, paddle.to_tensor([float("nan")])])
    n = with_nan.shape[0]
    cast, stored = (paddle.full([n], 7.0, dtype="bfloat16") for _ in range(2))
    _to_bf16_kernel[(1,)](*triton_args(with_nan, cast, stored), n, BLOCK=1024)
    want = x.astype("bfloat16").view("uint16").numpy()
    for got in (cast, stored):
        bits = got.view("uint16").numpy()
        np.testing.assert_array_equal(bits[:-1], want)
        assert np.isnan(got[-1:].astype("float32").numpy()).all()


def test_triton_mode_is_decided_once_and_reported_truthfully():
    """TRITON_INTERPRET set after the first op call: Triton's kernels are already compiled ones, so
    the interpreter cannot take CPU tensors. The backend reports so (it used to report Triton
    available, and the call then crashed inside Triton with an AttributeError) and an explicit
    request raises BackendUnavailableError naming the cause."""
    code = """
import os, warnings
import numpy as np, paddle
import paddlenlp_fused
from paddlenlp_fused import BackendUnavailableError, available_backends, swiglu
x = paddle.to_tensor(np.random.randn(4, 8).astype("float32"))
swiglu(x)  # the first call: Triton compiled (no interpreter), so the reference runs on CPU
os.environ["TRITON_INTERPRET"] = "1"
status = available_backends("cpu")["triton"]
assert not status.available and "was set after" in status.reason, status
try:
    swiglu(x, backend="triton")
except BackendUnavailableError as exc:
    assert "TRITON_INTERPRET was set after" in str(exc), exc
else:
    raise AssertionError("no error")
print("ok")
"""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "ok" in proc.stdout, proc.stdout + proc.stderr[-3000:]


def test_interpreter_mode_holds_after_the_env_changes(monkeypatch):
    assert B.interpreter_enabled()  # the suite runs in interpreter mode
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert B.interpreter_enabled() and "was unset after" in B.interpreter_mode_changed()
    status = paddlenlp_fused.available_backends("cpu")["triton"]
    assert status.available and "interpreter" in status.reason
    assert not paddlenlp_fused.available_backends("gpu")["triton"].available


def test_auto_order_is_one_table():
    from paddlenlp_fused.ops import causal_conv1d, mamba, norm

    assert norm.auto_order(4096) == B.gpu_order("layer_norm", N=4096) == ("triton", "cuda")
    assert norm.auto_order(1024) == B.gpu_order("rms_norm", N=1024) == ("cuda", "triton")
    assert mamba.SCAN_AUTO_ORDER == B.gpu_order("selective_scan")
    assert causal_conv1d.AUTO_ORDER == B.gpu_order("causal_conv1d")
    assert B.gpu_order("linear_cross_entropy") == B.DEFAULT_GPU_ORDER
    for op, order in B.AUTO_ORDER.items():
        got = B.gpu_order(op, N=2048) if callable(order) else B.gpu_order(op)
        assert sorted(got) == ["cuda", "triton"], (op, got)
    statuses = {name: B.BackendStatus(True, "ok") for name in B.BACKENDS}
    monkeypatch = pytest.MonkeyPatch()
    with monkeypatch.context() as m:
        m.setattr(B, "backend_status", lambda name, device: statuses[name])
        assert B.resolve_backend("selective_scan", "auto", "gpu", ("cuda", "triton", "reference")) == "triton"
        assert B.resolve_backend("fused_dense", "auto", "gpu", ("cuda", "triton", "reference")) == "cuda"


def test_version_ranges_and_check(monkeypatch):
    from paddlenlp_fused.runtime import versions as V

    assert V.PADDLE_SPEC == ">=3.2,<3.4" and V.TRITON_SPEC == ">=3.6,<3.7"
    assert V.parse(V.PADDLE_OLDEST) == V.PADDLE_SUPPORTED[0]
    assert V.parse("3.2.0.post120") == (3, 2) and V.parse("3.6.0+git1") == (3, 6)
    with pytest.raises(ValueError, match="MAJOR.MINOR"):
        V.parse("dev")
    assert "paddle.empty(device=...)" in V.paddle_problem("3.1.1")
    assert V.paddle_problem("3.2.0") is None and V.paddle_problem("3.3.1") is None
    assert V.paddle_problem("0.0.0") is None  # a source build
    assert V.paddle_untested("3.4.0") and V.paddle_untested("3.3.1") is None
    assert V.triton_problem("3.6.0") is None and ">=3.6,<3.7" in V.triton_problem("3.7.0")
    assert V.triton_problem("3.5.1")

    installed = {"paddlepaddle-gpu": "3.1.0"}

    def version(name):
        if name not in installed:
            raise V.importlib.metadata.PackageNotFoundError(name)
        return installed[name]

    monkeypatch.setattr(V.importlib.metadata, "version", version)
    assert V.installed_paddle() == ("paddlepaddle-gpu", "3.1.0")
    with pytest.raises(ImportError, match=r"needs Paddle >=3.2,<3.4, found 3.1.0"):
        V.check_versions()
    installed["paddlepaddle-gpu"] = "3.4.0"
    with pytest.warns(RuntimeWarning, match="tested with Paddle >=3.2,<3.4, found 3.4.0"):
        V.check_versions()
    installed.clear()
    V.check_versions()  # no Paddle (the kernels alone, under torch): nothing to check
    monkeypatch.setattr(B.versions, "triton_problem", lambda v: f"triton {v} is outside the supported range")
    status = paddlenlp_fused.available_backends("gpu")["triton"]
    assert not status.available and "outside the supported range" in status.reason


def test_import_fails_clearly_on_an_old_paddle(tmp_path):
    """A Paddle older than the range: ``import paddlenlp_fused`` raises ImportError naming the range
    (before any op can fail with an AttributeError deep in Paddle)."""
    dist = tmp_path / "paddlepaddle-3.1.0.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: paddlepaddle\nVersion: 3.1.0\n")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(tmp_path)] + sys.path))
    proc = subprocess.run([sys.executable, "-c", "import paddlenlp_fused"], env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "ImportError: paddlenlp_fused needs Paddle >=3.2,<3.4, found 3.1.0" in proc.stderr, \
        proc.stderr[-2000:]


def test_paddle_driver_is_scoped_and_restored(monkeypatch):
    """On the GPU (here: stand-in drivers and tensors that report a GPU), the Paddle driver and its
    allocator replace Triton's only until the outermost scope ends (or, outside any scope, until
    restore_triton_driver()): a torch Triton kernel in the same process gets its own back."""
    from triton.runtime import _allocation, driver

    from paddlenlp_fused.runtime import triton_paddle

    def stand_in(api=None):
        made = type("Driver", (), {})()
        made.api, made.scratch_allocator = api, lambda size, alignment, stream: None
        return made

    monkeypatch.setattr(triton_paddle, "make_driver", stand_in)
    monkeypatch.setattr(triton_paddle, "device_kind", lambda t: "gpu")
    monkeypatch.setattr(triton_paddle, "_gpu_driver", None)
    monkeypatch.setattr(triton_paddle, "_previous", None)
    before, allocator = driver._active, _allocation._allocator.get()

    def paddle_driver_active(expected=None):
        expected = expected or triton_paddle._gpu_driver
        return driver._active is expected and _allocation._allocator.get() is expected.scratch_allocator

    def given_back():
        return driver._active is before and _allocation._allocator.get() is allocator

    with triton_paddle.paddle_triton_driver() as active:
        assert paddle_driver_active(active)
        with triton_paddle.paddle_triton_driver():  # nested: the outer scope restores
            pass
        assert paddle_driver_active(active)
    assert given_back()

    @triton_paddle.triton_scoped
    def op(fail=False):
        x = paddle.ones([2])
        assert triton_paddle.triton_args(x) == (x,)
        assert paddle_driver_active()
        if fail:
            raise RuntimeError("in the op")

    op()
    assert given_back()
    with pytest.raises(RuntimeError, match="in the op"):
        op(fail=True)
    assert given_back()

    api = object()  # a stand-in PaddleDevice (the GPU suite's torch-backed one): ops inside use it too
    default = triton_paddle._gpu_driver
    with triton_paddle.paddle_triton_driver(api) as active:
        assert active.api is api
        op()
        assert paddle_driver_active(active)
    assert given_back() and triton_paddle._gpu_driver is default

    triton_paddle.install_paddle_driver()
    assert paddle_driver_active()
    op()  # an op gives back what was active before it: the installed driver
    assert paddle_driver_active()
    triton_paddle.restore_triton_driver()
    assert given_back()


def test_cuda_backend_reports_an_old_driver():
    from paddlenlp_fused.kernels.cuda import library

    assert "no NVIDIA driver" in library.driver_problem((13, 0), None)
    problem = library.driver_problem((13, 0), 12080)
    assert "supports CUDA 12.8" in problem and "built with CUDA 13.0" in problem
    assert library.driver_problem((13, 0), 13000) is None and library.driver_problem((13, 0), 13020) is None
    assert library.driver_problem((12, 4), 12020) is None  # minor-version compatibility
    if library.library_path().is_file():
        assert library.runtime_version(library.library_path())[0] >= 11
        if library.driver_version() is None:  # this machine has no driver: reported, not raised
            available, reason = library.status()
            assert not available and "no NVIDIA driver" in reason
            with pytest.raises(RuntimeError, match="CUDA kernel library unavailable: no NVIDIA driver"):
                library.get()


def test_gpu_provider_reports_which_provider_runs_and_why(monkeypatch):
    from paddlenlp_fused.testing import providers as P

    class Stub:
        name = "torch"

    monkeypatch.setattr(P, "TorchProvider", Stub)
    monkeypatch.setattr(P, "_torch_gpu_problem", lambda: None)
    assert "CPU build" in P._paddle_gpu_problem()  # this machine's Paddle
    with pytest.warns(UserWarning, match="GPU tensors from torch, because paddle .* is a CPU build"):
        provider = P.gpu_provider()
    assert isinstance(provider, Stub) and provider.selection.startswith("torch, because")
    monkeypatch.setattr(P, "_torch_gpu_problem", lambda: "torch is not installed")
    assert P.gpu_provider() is None
