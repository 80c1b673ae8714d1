"""Fused dense / MLP on the CPU: the ops and layers (Triton kernels in the interpreter, and the
reference) against a float64 reference and the plain Paddle composition, values and every gradient,
for each activation; checkpoint levels bit-identical with decreasing saved bytes; the GEMM launcher's
epilogues with poisoned outputs; bad input."""

import math

import numpy as np
import paddle
import paddle.nn as nn
import pytest

from paddlenlp_fused.distributed.comm import ParallelGroup
from paddlenlp_fused.kernels.triton import fused_dense as triton_kernels
from paddlenlp_fused.layers.fused_dense import FusedDense, FusedMLP
from paddlenlp_fused.layers.tensor_parallel import ColumnParallelLinear, ParallelFusedMLP, RowParallelLinear
from paddlenlp_fused.ops import fused_dense as fused_dense_ops
from paddlenlp_fused.ops.fused_dense import ACTIVATIONS, fused_dense_func, fused_mlp_func, record_saved_activations
from paddlenlp_fused.reference.fused_dense import activation_ref
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import assert_close, assert_close_to_terms, assert_sum_close, rel_err
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


def _mlp_sum_terms(x, w1, w2, b1, b2, activation, dy):
    """The magnitudes of the terms the weights' and biases' gradients sum over tokens, in float64:
    |x|^T |dpre|, |act|'^T |dy|, sum |dpre|, sum |dy| (dpre: the gradient of the pre-activation).
    |act|' adds to |act| what rounding the pre-activation moves it by per unit of relative error,
    |pre * dact/dpre| (summed over a gated pair): where the activation flattens towards 0 (GELU of
    a negative input), the activation's relative error is that many times the input's."""
    X, W1, W2, B1 = (as_leaf64(t) for t in (x, w1, w2, b1))
    pre = paddle.matmul(X, W1) + B1
    act = activation_ref(pre, activation)
    dY = paddle.to_tensor(to64(dy))
    dpre, = paddle.grad(act, [pre], paddle.matmul(dY, W2, transpose_y=True), retain_graph=True)
    slope, = paddle.grad(act, [pre], paddle.ones_like(act))  # each input feeds one output
    moved = np.abs(pre.numpy() * slope.numpy())
    if activation in GATED:
        moved = sum(np.split(moved, 2, axis=-1))
    rows = lambda t: np.abs(np.asarray(t).reshape(-1, np.shape(t)[-1]))  # noqa: E731
    act_terms = rows(act.numpy()) + rows(moved)
    return (rows(X.numpy()).T @ rows(dpre.numpy()), act_terms.T @ rows(dY.numpy()), rows(dpre.numpy()).sum(0),
            rows(dY.numpy()).sum(0))


def _check_against_float64(results, x, w1, w2, b1, b2, activation, dy, dtype):
    """Values and the input's gradient against float64 within DESIGN.md's bound (2x the plain
    composition's error in 16-bit dtypes); the weights' and biases' gradients, sums over tokens
    that cancel (one element of a bias gradient carried 90% of a draw's norm-wise error), by
    DESIGN.md's measure for sums."""
    exact = [t.numpy() for t in _mlp_float64(x, w1, w2, b1, b2, activation, dy)]
    plain = [t.numpy() for t in _mlp_plain(x, w1, w2, b1, b2, activation, dy, dtype)] if dtype != "float32" \
        else [None] * 6
    for name, ours, ref, base in list(zip(NAMES, results, exact, plain))[:2]:
        baseline = rel_err(base, ref) if base is not None else None
        assert_close(f"{activation} {name}", to64(ours), ref, dtype, baseline_err=baseline)
    terms = _mlp_sum_terms(x, w1, w2, b1, b2, activation, dy)
    for name, ours, ref, term in zip(NAMES[2:], results[2:], exact[2:], terms):
        assert_sum_close(f"{activation} {name}", to64(ours), ref, term, dtype)


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
def test_mlp_float16_triton_and_float32_bfloat16_reference(activation):
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


def _poisoned(shape, dtype):
    return paddle.full(list(shape), float("nan"), dtype=dtype)


def _act_grad_term_magnitudes(x, activation):
    """|a| + |b| of act'(x) = a + b, the form the kernels evaluate, in float64."""
    if activation == "gelu":
        return np.abs(0.5 * (1.0 + np.vectorize(math.erf)(x / math.sqrt(2.0)))) + \
            np.abs(x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi))
    if activation == "gelu_approx":
        k = math.sqrt(2.0 / math.pi)
        t = np.tanh(k * (x + 0.044715 * x**3))
        return np.abs(0.5 * (1.0 + t)) + np.abs(0.5 * x * (1.0 - t * t) * k * (1.0 + 3 * 0.044715 * x * x))
    return np.abs(2.0 * np.maximum(x, 0.0)) if activation == "sqrelu" else (x > 0).astype(np.float64)


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("shape", [(1, 1), (15, 33), (70, 5)], ids=str)
def test_activation_backward_pass_with_bias_gradient(dtype, shape):
    """act_bwd_dbias: dpre = dout * act'(pre) and its column sums in one pass (row splits summed in a
    second kernel); column_sum alone. Outputs poisoned, rows at a stride past their width."""
    M, N = shape
    for activation in ("gelu_approx", "gelu", "relu", "sqrelu"):
        pre = randn((M, N + 3), dtype)[:, 2:2 + N]  # a column slice: row stride N + 3
        dout = randn((M, N), dtype)
        dpre, dbias = _poisoned((M, N), dtype), _poisoned((N,), dtype)
        partial = _poisoned(triton_kernels.colsum_partial_shape(M, N), "float32")
        triton_kernels.act_bwd_dbias(*triton_args(pre, dout, dpre, dbias, partial), activation=activation)
        again = _poisoned((M, N), dtype)
        triton_kernels.act_bwd(*triton_args(pre.contiguous(), dout, again), activation=activation)
        np.testing.assert_array_equal(to64(dpre), to64(again), err_msg=activation)  # the elementwise kernel's values
        h = as_leaf64(pre)
        act = activation_ref(h, activation)
        (grad,) = paddle.grad(act, [h], paddle.to_tensor(to64(dout)))
        # gelu's derivative is a sum of two terms that cancel for negative inputs
        terms = np.abs(to64(dout)) * _act_grad_term_magnitudes(to64(pre), activation)
        assert_sum_close(f"{activation} dpre", to64(dpre), grad.numpy(), terms, dtype)
        stored = to64(dpre)  # the bias gradient sums the stored dpre in fp32
        assert_close_to_terms(f"{activation} dbias", to64(dbias), stored.sum(0), np.abs(stored).sum(0), dtype)
    out = _poisoned((N,), "float32")
    partial = _poisoned(triton_kernels.colsum_partial_shape(M, N), "float32")
    triton_kernels.column_sum(*triton_args(dout, out, partial))
    assert_close_to_terms("column_sum", out.numpy(), to64(dout).sum(0), np.abs(to64(dout)).sum(0), "float32")


def test_column_sum_passes_reject_bad_workspaces():
    pre, dout, dpre, dbias = randn((9, 6)), randn((9, 6)), randn((9, 6)), randn((6,))
    shape = triton_kernels.colsum_partial_shape(9, 6)
    with pytest.raises(ValueError, match="partial: expected shape"):
        triton_kernels.act_bwd_dbias(*triton_args(pre, dout, dpre, dbias, randn((shape[0] + 1, 6))), "relu")
    with pytest.raises(TypeError, match="partial: expected dtype float32"):
        triton_kernels.column_sum(*triton_args(dout, dbias, randn(shape, "bfloat16")))
    with pytest.raises(TypeError, match="pre: expected dtype float32"):
        triton_kernels.act_bwd_dbias(*triton_args(pre.astype("bfloat16"), dout, dpre, dbias, randn(shape)), "relu")
    with pytest.raises(ValueError, match="activation"):
        triton_kernels.act_bwd_dbias(*triton_args(pre, dout, dpre, dbias, randn(shape)), "none")


@pytest.fixture
def plain_gemm_backward(monkeypatch):
    """The Triton kernel set run in the CUDA backend's backward order: plain input-gradient GEMMs,
    the activation's backward in the Triton pass that also sums the hidden bias's gradient, and
    weight-gradient GEMMs without it."""
    monkeypatch.setattr(fused_dense_ops._TritonKernels, "bwd_epilogue", frozenset())
    monkeypatch.setattr(fused_dense_ops._TritonKernels, "dbias_in_act_pass", True)


@pytest.mark.parametrize("activation", ["gelu_approx", "relu", "swiglu"])
def test_bias_gradient_from_the_activation_pass(plain_gemm_backward, activation):
    """The backward order of the CUDA backend, run with Triton kernels: values against float64 and
    the plain bf16 composition, and bit-identical at every checkpoint level."""
    x = randn((3, 7, 16), "bfloat16", requires_grad=True)
    params = _mlp_params(activation, "bfloat16")
    dy = randn((3, 7, 12), "bfloat16")
    results = [_run_mlp(x, params, dy, activation=activation, checkpoint_lvl=level, backend="triton")
               for level in (0, 1, 2)]
    _check_against_float64(results[0], x, *params, activation, dy, "bfloat16")
    for level in (1, 2):
        for name, a, b in zip(NAMES, results[0], results[level]):
            np.testing.assert_array_equal(to64(a), to64(b), err_msg=f"{name} at level {level} vs 0")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_amp_o1_float32_parameters_with_low_precision_activations(dtype):
    """AMP O1 (fp32 master weights, 16-bit activations): matmuls in x's dtype, as Paddle's O1 casts
    them; the fp32 parameters get fp32 gradients equal to the 16-bit ones. Raised TypeError before."""
    x = randn((2, 5, 16), dtype, requires_grad=True)
    params32 = _mlp_params("gelu_approx", "float32")
    dy = randn((2, 5, 12), dtype)
    with paddle.amp.auto_cast(level="O1", dtype=dtype):  # a no-op in Paddle's CPU build; the op must agree
        out = fused_mlp_func(x, *params32, activation="gelu_approx", backend="triton")
    grads = paddle.grad(out, [x] + list(params32), dy)
    assert out.dtype == x.dtype and grads[0].dtype == x.dtype
    assert all(g.dtype == paddle.float32 for g in grads[1:])
    cast = [paddle.to_tensor(p.numpy()).astype(dtype) for p in params32]
    for p in cast:
        p.stop_gradient = False
    ref = _run_mlp(x, cast, dy, activation="gelu_approx", backend="triton")
    ordered = [out, grads[0], grads[1], grads[2], grads[3], grads[4]]  # out, dx, dw1, dw2, db1, db2
    for name, a, b in zip(NAMES, ordered, ref):
        np.testing.assert_array_equal(to64(a), to64(b), err_msg=name)
    _check_against_float64(ref, x, *cast, "gelu_approx", dy, dtype)

    w, b = randn((16, 9), "float32", requires_grad=True), randn((9,), "float32", requires_grad=True)
    dense = fused_dense_func(x, w, b, backend="triton")
    dx, dw, db = paddle.grad(dense, [x, w, b], randn((2, 5, 9), dtype))
    assert dense.dtype == x.dtype and dw.dtype == paddle.float32 and db.dtype == paddle.float32

    for layer in (FusedMLP(16, 24, 12, backend="triton"), ParallelFusedMLP(16, 24, 12, backend="triton")):
        out = layer(x)  # fp32 parameters
        out.astype("float32").sum().backward()
        assert out.dtype == x.dtype and layer.fc1.weight.grad.dtype == paddle.float32
        assert layer.fc2.bias.grad.dtype == paddle.float32


def test_amp_autocast_casts_float32_inputs(monkeypatch):
    """Inside an active auto_cast (simulated: Paddle's CPU build never enables it) float32 x and
    parameters run in its dtype, as the O1 white list casts matmul's inputs."""
    x = randn((6, 16), "float32", requires_grad=True)
    params = _mlp_params("relu", "float32")
    dy = randn((6, 12), "bfloat16")
    monkeypatch.setattr(paddle.amp, "is_autocast_enabled", lambda *a, **k: True)
    monkeypatch.setattr(paddle.amp, "get_autocast_dtype", lambda *a, **k: paddle.bfloat16)
    out = fused_mlp_func(x, *params, activation="relu", backend="triton")
    grads = paddle.grad(out, [x] + list(params), dy)
    monkeypatch.undo()
    assert out.dtype == paddle.bfloat16 and all(g.dtype == paddle.float32 for g in grads)
    leaves = [paddle.to_tensor(t.numpy()).astype("bfloat16") for t in [x] + list(params)]
    for t in leaves:
        t.stop_gradient = False
    ref = fused_mlp_func(*leaves, activation="relu", backend="triton")
    ref_grads = paddle.grad(ref, leaves, dy)
    np.testing.assert_array_equal(to64(out), to64(ref))
    for g, r in zip(grads, ref_grads):
        np.testing.assert_array_equal(to64(g), to64(r))


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_gradients_accumulate_when_one_tensor_is_several_inputs(backend):
    """One tensor as weight1 and weight2, and x feeding another branch: Paddle adds the gradients
    the op returns, so each must be its own tensor (none aliasing another, an input or a saved one)."""
    D = 12
    x = randn((5, D), "float32", requires_grad=True)
    w = randn((D, D), "float32", scale=D**-0.5, requires_grad=True)
    b = randn((D,), "float32", requires_grad=True)
    dy = randn((5, D), "float32")

    def grads(mlp):
        out = mlp(x, w, b) + x * 2.0 + fused_dense_func(x, w, b, backend=backend)
        return [out] + list(paddle.grad(out, [x, w, b], dy))

    ours = grads(lambda x, w, b: fused_mlp_func(x, w, w, b, b, activation="relu", backend=backend))
    plain = grads(lambda x, w, b: paddle.matmul(paddle.nn.functional.relu(paddle.matmul(x, w) + b), w) + b)
    for name, a, r in zip(("out", "dx", "dweight", "dbias"), ours, plain):
        assert_close(name, to64(a), to64(r), "float32")


class _FakeCublasLt:
    """The cuBLASLt launchers' interface (kernels/cuda/fused_dense.py) computed by the Triton GEMM in
    the interpreter, recording each call's kind and heuristic index: runs the CUDA kernel set's
    orchestration on the CPU."""

    def __init__(self):
        self.calls = []

    @staticmethod
    def aux_shape(activation, M, N):
        return (M, -(-N // 8) * 8), None

    def linear_act_fwd(self, x, w, out, workspace, bias=None, activation="none", aux=None,
                       weight_transposed=False, heuristic=0):
        assert aux is None or aux.shape[1] == out.shape[1]  # the tests' widths are multiples of 8
        self.calls.append(("dgrad" if weight_transposed else "fwd", activation, aux is not None, heuristic))
        _gemm(x, w, out, bias=bias, activation=activation, pre=aux, trans_b=weight_transposed)

    def linear_wgrad(self, x, dout, dweight, workspace, dbias=None, heuristic=0):
        self.calls.append(("wgrad_bgrad" if dbias is not None else "wgrad", heuristic))
        _gemm(x, dout, dweight, dbias=dbias, trans_a=True)


@pytest.fixture
def fake_cuda(monkeypatch):
    lt = _FakeCublasLt()

    class FakeCudaKernels(fused_dense_ops._CudaKernels):
        def __init__(self, heuristic, dtype):
            super().__init__(heuristic, dtype)
            self.k = lt

        def workspace(self, like):
            return None

    monkeypatch.setitem(fused_dense_ops._KERNELS, "triton", FakeCudaKernels)
    return lt


@pytest.mark.parametrize("fwd_gelu,bgrad", [(True, False), (False, False), (True, True)])
@pytest.mark.parametrize("activation", ["gelu_approx", "swiglu"])
def test_cuda_kernel_set_orchestration(fake_cuda, monkeypatch, activation, fwd_gelu, bgrad):
    """The CUDA backend's sequence (kernel set ``_CudaKernels``) for each choice of the tuning
    module: values and gradients against float64 and the plain bf16 composition, bit-identical
    across checkpoint levels, the bias gradients from the epilogue or the Triton passes as chosen,
    and each GEMM's heuristic index read from the tuning table."""
    from paddlenlp_fused.kernels.cuda import fused_dense_tuning as tuning

    monkeypatch.setattr(tuning, "FWD_GELU_EPILOGUE", fwd_gelu)
    monkeypatch.setattr(tuning, "BGRAD_EPILOGUE", bgrad)
    M, D, H = 21, 16, 24
    W = 2 * H if activation in GATED else H
    monkeypatch.setattr(tuning, "HEURISTIC", {("dgrad", "bfloat16", M, D, W): 5, ("wgrad", "bfloat16", H, 12, M): 3})
    x = randn((3, 7, D), "bfloat16", requires_grad=True)
    params = _mlp_params(activation, "bfloat16", D=D, H=H)
    dy = randn((3, 7, 12), "bfloat16")
    results = []
    for level in (0, 1, 2):
        fake_cuda.calls.clear()
        results.append(_run_mlp(x, params, dy, activation=activation, checkpoint_lvl=level, backend="triton"))
        calls = list(fake_cuda.calls)
        gelu_in_gemm = fwd_gelu and activation == "gelu_approx"
        assert calls[0] == ("fwd", "gelu_approx" if gelu_in_gemm else "none", gelu_in_gemm, 0)
        assert ("dgrad", "none", False, 5) in calls  # dx = dpre @ W1^T: the table's index
        wgrads = [c for c in calls if c[0].startswith("wgrad")]
        assert wgrads == [("wgrad_bgrad", 0) if bgrad else ("wgrad", 3), ("wgrad_bgrad", 0) if bgrad else ("wgrad", 0)]
    _check_against_float64(results[0], x, *params, activation, dy, "bfloat16")
    for level in (1, 2):
        for name, a, b in zip(NAMES, results[0], results[level]):
            np.testing.assert_array_equal(to64(a), to64(b), err_msg=f"{name} at level {level} vs 0")
    again = _run_mlp(x, params, dy, activation=activation, heuristic=6, backend="triton")
    assert {c[-1] for c in fake_cuda.calls[-6:]} == {6}  # an explicit index applies to every GEMM
    for name, a, b in zip(NAMES, results[0], again):
        np.testing.assert_array_equal(to64(a), to64(b), err_msg=name)
