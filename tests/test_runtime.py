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


def test_auto_on_cpu_picks_triton_in_interpreter_mode_else_reference(monkeypatch):
    impl = ("triton", "reference")
    assert B.resolve_backend("op", "auto", "cpu", impl) == "triton"
    with paddlenlp_fused.use_backend("reference"):
        assert B.resolve_backend("op", "auto", "cpu", impl) == "reference"
    monkeypatch.setenv("TRITON_INTERPRET", "0")
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
