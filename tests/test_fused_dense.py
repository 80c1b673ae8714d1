"""Fused dense / MLP on the CPU: the ops and layers (Triton kernels in the interpreter, and the
reference) against a float64 reference and the plain Paddle composition, values and every gradient,
for each activation; checkpoint levels bit-identical with decreasing saved bytes; the GEMM launcher's
epilogues with poisoned outputs; bad input."""

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddlenlp_fused.distributed.comm import ParallelGroup
from paddlenlp_fused.kernels.triton import fused_dense as triton_kernels
from paddlenlp_fused.layers.fused_dense import FusedDense, FusedMLP
from paddlenlp_fused.layers.tensor_parallel import ColumnParallelLinear, ParallelFusedMLP, RowParallelLinear
from paddlenlp_fused.ops.fused_dense import ACTIVATIONS, fused_dense_func, fused_mlp_func, record_saved_activations
from paddlenlp_fused.reference.fused_dense import activation_ref
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import assert_close, rel_err
from helpers import as_leaf64, randn, to64

GATED = ("swiglu", "geglu")
NAMES = ("out", "dx", "dweight1", "dweight2", "dbias1", "dbias2")


def _mlp_params(activation, dtype, D=16, H=24, O=12):
    w1 = randn((D, 2 * H if activation in GATED else H), dtype, scale=D**-0.5, requires_grad=True)
    w2 = randn((H, O), dtype, scale=H**-0.5, requires_grad=True)
    b1 = randn((w1.shape[1],), dtype, requires_grad=True)
    b2 = randn((O,), dtype, requires_grad=True)
    return w1, w2, b1, b2


def _mlp_float64(x, w1, w2, b1, b2, activation, dy):
    """The exact MLP and its gradients in float64."""
    leaves = [as_leaf64(t) for t in (x, w1, w2, b1, b2)]
    X, W1, W2, B1, B2 = leaves
    out = paddle.matmul(activation_ref(paddle.matmul(X, W1) + B1, activation), W2) + B2
    return [out] + list(paddle.grad(out, leaves, paddle.to_tensor(to64(dy))))


def _mlp_plain(x, w1, w2, b1, b2, activation, dy, dtype):
    """The plain Paddle composition in ``dtype``: fp32 arithmetic rounded to dtype after every op,
    forward and backward (a cast's gradient is cast too), as the framework's dtype kernels do."""
    def rnd(t):
        return t.astype(dtype).astype("float32")

    leaves = [paddle.to_tensor(t.astype("float32").numpy(), stop_gradient=False) for t in (x, w1, w2, b1, b2)]
    X, W1, W2, B1, B2 = leaves
    h = rnd(rnd(paddle.matmul(X, W1)) + B1)
    out = rnd(rnd(paddle.matmul(rnd(activation_ref(h, activation)), W2)) + B2)
    return [out] + list(paddle.grad(out, leaves, dy.astype("float32")))


def _check_against_float64(results, x, w1, w2, b1, b2, activation, dy, dtype):
    exact = [t.numpy() for t in _mlp_float64(x, w1, w2, b1, b2, activation, dy)]
    plain = [t.numpy() for t in _mlp_plain(x, w1, w2, b1, b2, activation, dy, dtype)] if dtype != "float32" \
        else [None] * 6
    for name, ours, ref, base in zip(NAMES, results, exact, plain):
        baseline = rel_err(base, ref) if base is not None else None
        assert_close(f"{activation} {name}", to64(ours), ref, dtype, baseline_err=baseline)


def _run_mlp(x, params, dy, **kwargs):
    w1, w2, b1, b2 = params
    out = fused_mlp_func(x, w1, w2, b1, b2, **kwargs)
    return [out] + list(paddle.grad(out, [x, w1, w2, b1, b2], dy))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_mlp_values_and_gradients_match_float64(activation, dtype):
    x = randn((2, 9, 16), dtype, requires_grad=True)
    params = _mlp_params(activation, dtype)
    dy = randn((2, 9, 12), dtype)
    results = _run_mlp(x, params, dy, activation=activation, backend="triton")
    assert results[0].dtype == x.dtype and list(results[0].shape) == [2, 9, 12]
    _check_against_float64(results, x, *params, activation, dy, dtype)


@pytest.mark.parametrize("activation", ["gelu_approx", "swiglu"])
def test_mlp_float16_and_reference_backend(activation):
    for dtype, backend in (("float16", "triton"), ("float32", "reference"), ("bfloat16", "reference")):
        x = randn((7, 16), dtype, requires_grad=True)
        params = _mlp_params(activation, dtype)
        dy = randn((7, 12), dtype)
        results = _run_mlp(x, params, dy, activation=activation, backend=backend)
        _check_against_float64(results, x, *params, activation, dy, dtype)


@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_checkpoint_levels_give_identical_gradients_and_save_less(activation):
    """Level 1 and 2 recompute what level 0 saves: bit-identical outputs and gradients; saved bytes
    strictly decrease, level 2 keeping at most a third of level 0 (hidden = 4 * in, as in a
    transformer MLP)."""
    x = randn((3, 5, 8), "bfloat16", requires_grad=True)
    params = _mlp_params(activation, "bfloat16", D=8, H=32, O=8)
    dy = randn((3, 5, 8), "bfloat16")
    results, saved = [], []
    for level in (0, 1, 2):
        with record_saved_activations() as record:
            results.append(_run_mlp(x, params, dy, activation=activation, checkpoint_lvl=level, backend="triton"))
        saved.append(sum(record))
    for level in (1, 2):
        for name, a, b in zip(NAMES, results[0], results[level]):
            np.testing.assert_array_equal(to64(a), to64(b), err_msg=f"{name} at level {level} vs 0")
    assert saved[0] > saved[1] > saved[2] > 0, saved
    assert saved[2] * 3 <= saved[0], saved
    rows, itemsize = 15, 2
    assert saved[2] == rows * 8 * itemsize  # level 2 keeps only x


def test_mlp_without_biases_and_frozen_inputs():
    x = randn((6, 16), "float32")  # no gradient wanted for x
    w1, w2, _, _ = _mlp_params("relu", "float32")
    dy = randn((6, 12), "float32")
    out = fused_mlp_func(x, w1, w2, activation="relu", backend="triton")
    dw1, dw2 = paddle.grad(out, [w1, w2], dy)
    W1, W2 = as_leaf64(w1), as_leaf64(w2)
    ref = paddle.matmul(paddle.nn.functional.relu(paddle.matmul(paddle.to_tensor(to64(x)), W1)), W2)
    rdw1, rdw2 = paddle.grad(ref, [W1, W2], paddle.to_tensor(to64(dy)))
    assert_close("out", to64(out), ref.numpy(), "float32")
    assert_close("dweight1", to64(dw1), rdw1.numpy(), "float32")
    assert_close("dweight2", to64(dw2), rdw2.numpy(), "float32")
    with paddle.no_grad():  # the no-grad path (GEMM1's epilogue without a saved pre-activation)
        again = fused_mlp_func(x, w1, w2, activation="relu", backend="triton")
    np.testing.assert_array_equal(again.numpy(), out.numpy())


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_dense_func_values_gradients_and_residual(dtype):
    x = randn((3, 4, 20), dtype, requires_grad=True)
    w = randn((20, 9), dtype, scale=0.2, requires_grad=True)
    b = randn((9,), dtype, requires_grad=True)
    dy = randn((3, 4, 9), dtype)
    for backend in ("triton", "reference"):
        out, residual = fused_dense_func(x, w, b, return_residual=True, backend=backend)
        assert residual is x and list(out.shape) == [3, 4, 9]
        grads = paddle.grad(out, [x, w, b], dy)
        X, W, B = (as_leaf64(t) for t in (x, w, b))
        ref = paddle.matmul(X, W) + B
        refs = [ref] + list(paddle.grad(ref, [X, W, B], paddle.to_tensor(to64(dy))))
        for name, ours, r in zip(("out", "dx", "dweight", "dbias"), [out] + list(grads), refs):
            assert_close(f"{backend} {name}", to64(ours), r.numpy(), dtype)


def test_layers_equal_the_plain_paddle_layers_and_load_their_state_dicts():
    paddle.seed(7)
    linear = nn.Linear(16, 12)
    dense = FusedDense(16, 12, backend="triton")
    dense.set_state_dict(linear.state_dict())
    x = randn((5, 16), "float32", requires_grad=True)
    dy = randn((5, 12), "float32")
    for layer in (linear, dense):
        layer.clear_gradients()
    outs = [layer(x) for layer in (linear, dense)]
    grads = [paddle.grad(o, [x, layer.weight, layer.bias], dy) for o, layer in zip(outs, (linear, dense))]
    for a, b in zip([outs[0]] + list(grads[0]), [outs[1]] + list(grads[1])):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)

    for activation in ("gelu", "swiglu"):
        mlp = FusedMLP(16, 24, 12, activation=activation, backend="triton")
        assert sorted(mlp.state_dict()) == ["fc1.bias", "fc1.weight", "fc2.bias", "fc2.weight"]
        out = mlp(x)
        # every input that takes a gradient: a PyLayer cannot leave one out in paddle.grad (Paddle 3.3)
        inputs = [x, mlp.fc1.weight, mlp.fc1.bias, mlp.fc2.weight, mlp.fc2.bias]
        grads = paddle.grad(out, inputs, dy)
        plain = paddle.matmul(activation_ref(mlp.fc1(x), activation), mlp.fc2.weight) + mlp.fc2.bias
        plain_grads = paddle.grad(plain, inputs, dy)
        for name, a, b in zip(("out", "dx", "dweight1", "dbias1", "dweight2", "dbias2"), [out] + list(grads),
                              [plain] + list(plain_grads)):
            assert_close(f"FusedMLP {activation} {name}", to64(a), to64(b), "float32")


def test_parallel_layers_without_a_group_are_single_process_layers():
    paddle.seed(3)
    column = ColumnParallelLinear(16, 12, has_bias=True, backend="triton")
    row = RowParallelLinear(12, 8, backend="triton")
    mlp = ParallelFusedMLP(16, 32, activation="swiglu", backend="triton")
    assert not column.weight.is_distributed and list(column.weight.shape) == [16, 12]
    assert list(mlp.fc1.weight.shape) == [16, 64] and list(mlp.fc2.weight.shape) == [32, 16]
    x = randn((4, 16), "float32")
    np.testing.assert_allclose(row(column(x)).numpy(),
                               ((x.numpy() @ column.weight.numpy() + column.bias.numpy()) @ row.weight.numpy()
                                + row.bias.numpy()), rtol=1e-5, atol=1e-5)
    assert list(mlp(x).shape) == [4, 16]


def _gemm(a, b, c, **kwargs):
    """The Triton GEMM launcher on Paddle CPU tensors (each tensor wrapped for the interpreter)."""
    names = [k for k, v in kwargs.items() if isinstance(v, paddle.Tensor)]
    wrapped = triton_args(a, b, c, *(kwargs[k] for k in names))
    triton_kernels.gemm(*wrapped[:3], **dict(kwargs, **dict(zip(names, wrapped[3:]))))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1, 1), (17, 33, 5), (40, 3, 70)], ids=str)
def test_gemm_launcher_epilogues_write_every_element(dtype, shape):
    """Each epilogue of the Triton GEMM at odd shapes, outputs poisoned with NaN."""
    M, K, N = shape
    a, w, bias = randn((M, K), dtype), randn((K, N), dtype, scale=0.5), randn((N,), dtype)

    def poisoned(*dims, dt=dtype):
        return paddle.full(list(dims), float("nan"), dtype=dt)

    out, pre = poisoned(M, N), poisoned(M, N)
    _gemm(a, w, out, bias=bias, activation="sqrelu", pre=pre)
    assert_close("pre", to64(pre), to64(a) @ to64(w) + to64(bias), dtype)
    assert_close("sqrelu(pre)", to64(out), np.maximum(to64(pre), 0) ** 2, dtype)

    dout, w_nk, dpre = randn((M, K), dtype), randn((N, K), dtype, scale=0.5), poisoned(M, N)
    _gemm(dout, w_nk, dpre, activation="sqrelu", pre=pre, act_grad=True, trans_b=True)
    assert_close("act_grad", to64(dpre), (to64(dout) @ to64(w_nk).T) * 2 * np.maximum(to64(pre), 0), dtype)

    dy, dw, db = randn((M, N), dtype), poisoned(K, N), poisoned(N, dt="float32")
    _gemm(a, dy, dw, dbias=db, trans_a=True)
    assert_close("wgrad", to64(dw), to64(a).T @ to64(dy), dtype)
    assert_close("bias grad", db.numpy(), to64(dy).sum(0), "float32")


def test_elementwise_activation_kernels_match_the_epilogue_bit_for_bit():
    x, w, bias = randn((9, 20), "bfloat16"), randn((20, 33), "bfloat16"), randn((33,), "bfloat16")
    for activation in ("gelu_approx", "gelu", "relu", "sqrelu"):
        out, pre, again = (paddle.empty([9, 33], dtype="bfloat16") for _ in range(3))
        _gemm(x, w, out, bias=bias, activation=activation, pre=pre)
        triton_kernels.act_fwd(*triton_args(pre, again), activation=activation)
        np.testing.assert_array_equal(to64(again), to64(out), err_msg=activation)


def test_bad_input_raises_clear_errors():
    x = randn((4, 8))
    w1, w2 = randn((8, 16)), randn((16, 8))
    with pytest.raises(ValueError, match="weight1: expected shape \\[8, out\\]"):
        fused_mlp_func(x, randn((7, 16)), w2)
    with pytest.raises(ValueError, match="weight1: expected 32 columns"):
        fused_mlp_func(x, w1, w2, activation="swiglu")
    with pytest.raises(ValueError, match="bias1: expected shape \\[16\\]"):
        fused_mlp_func(x, w1, w2, bias1=randn((15,)))
    with pytest.raises(TypeError, match="weight2: expected dtype float32"):
        fused_mlp_func(x, w1, w2.astype("float16"))
    with pytest.raises(ValueError, match="activation: expected one of"):
        fused_mlp_func(x, w1, w2, activation="tanh")
    with pytest.raises(ValueError, match="checkpoint_lvl: expected 0, 1 or 2"):
        fused_mlp_func(x, w1, w2, checkpoint_lvl=3)
    with pytest.raises(ValueError, match="heuristic: expected 'auto' or an index"):
        fused_mlp_func(x, w1, w2, heuristic=-1)
    with pytest.raises(TypeError, match="x: expected a paddle.Tensor"):
        fused_dense_func(np.ones((4, 8), np.float32), w1)
    with pytest.raises(ValueError, match="weight: expected shape \\[8, out\\]"):
        fused_dense_func(x, w2)
    with pytest.raises(BackendUnavailableError, match="cuda"):
        fused_dense_func(x, w1, backend="cuda")
    with pytest.raises(ValueError, match="backend"):
        fused_dense_func(x, w1, backend="cublas")
    two_ranks = ParallelGroup(group=None, world_size=2, rank=0, src_rank=0)
    with pytest.raises(ValueError, match="out_features: 7 does not divide by the model-parallel size 2"):
        ColumnParallelLinear(8, 7, mp_group=two_ranks)
    with pytest.raises(ValueError, match="in_features: 9 does not divide by the model-parallel size 2"):
        RowParallelLinear(9, 8, mp_group=two_ranks)
    with pytest.raises(ValueError, match="hidden_features: 5 does not divide"):
        ParallelFusedMLP(8, 5, mp_group=two_ranks)
    with pytest.raises(ValueError, match="gather_output: must be False with sequence_parallel"):
        ColumnParallelLinear(8, 8, sequence_parallel=True)


def test_empty_batch_falls_back_to_the_reference():
    x = randn((0, 8), "float32", requires_grad=True)
    w1, w2, b1, b2 = _mlp_params("gelu_approx", "float32", D=8, H=16, O=4)
    out = fused_mlp_func(x, w1, w2, b1, b2)
    assert list(out.shape) == [0, 4]
    dx, dw1, db1, dw2, db2 = paddle.grad(out, [x, w1, b1, w2, b2], paddle.zeros([0, 4]))
    assert list(dx.shape) == [0, 8] and not np.any(dw1.numpy()) and not np.any(db2.numpy())
