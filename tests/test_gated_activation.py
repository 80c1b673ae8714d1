"""SwiGLU / GeGLU: Triton kernels (interpreter) and the reference against float64, values and
gradients, through the Paddle op; launcher-level poisoned-output checks; bad input."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_fused.kernels.triton.gated_activation import gated_activation_fwd
from paddlenlp_fused.ops import geglu, swiglu
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import assert_close
from helpers import DTYPES, as_leaf64, randn, to64

OPS = {"swiglu": (swiglu, lambda a: F.silu(a)), "geglu": (geglu, lambda a: F.gelu(a, approximate=True))}
SHAPES = [(1, 2), (7, 66), (2, 3, 10), (5, 2 * 129), (0, 8)]


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", sorted(OPS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_values_and_grad_match_float64(name, dtype, backend, shape):
    op, act64 = OPS[name]
    x = randn(shape, dtype, requires_grad=True)
    y = op(x, backend=backend)
    assert y.dtype == x.dtype and list(y.shape) == list(shape[:-1]) + [shape[-1] // 2]
    dy = randn(y.shape, dtype)
    (dx,) = paddle.grad(y, x, dy)

    x64 = as_leaf64(x)
    gate, up = paddle.chunk(x64, 2, axis=-1)
    y64 = act64(gate) * up
    (dx64,) = paddle.grad(y64, x64, paddle.to_tensor(to64(dy)))
    if not np.prod(shape):
        return
    assert_close(f"{name} out", to64(y), y64.numpy(), dtype)
    assert_close(f"{name} dx", to64(dx), dx64.numpy(), dtype)


def test_swiglu_equals_paddle_swiglu():
    x = randn((4, 3, 38), "float32")
    np.testing.assert_allclose(swiglu(x, backend="triton").numpy(), F.swiglu(x).numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
def test_launcher_writes_every_element_of_strided_rows(dtype):
    """Rows at a stride larger than 2H (a column slice of a wider buffer), output poisoned with NaN."""
    big = randn((6, 40), dtype)
    x = big[:, 4:26]  # [6, 22], row stride 40
    assert x.strides[0] == 40
    out = paddle.full([6, 11], float("nan"), dtype=dtype)
    gated_activation_fwd(*triton_args(x, out), activation="silu")
    x64 = to64(x)
    ref = x64[:, :11] / (1 + np.exp(-x64[:, :11])) * x64[:, 11:]
    assert_close("strided swiglu", to64(out), ref, dtype)


def test_bad_input_raises_clear_errors():
    with pytest.raises(ValueError, match="x: last axis must be even"):
        swiglu(randn((3, 5)))
    with pytest.raises(TypeError, match="x: expected dtype"):
        swiglu(paddle.ones([3, 4], dtype="int32"))
    with pytest.raises(TypeError, match="x: expected a paddle.Tensor"):
        swiglu(np.ones((3, 4), np.float32))
    with pytest.raises(ValueError, match="backend"):
        swiglu(randn((3, 4)), backend="cudnn")
