"""LayerNorm / RMSNorm / gated RMSNorm: Triton kernels (interpreter) and the reference against
float64 (``paddle.nn.functional.layer_norm`` or a float64 composition), values and the gradients of
every input, through the Paddle ops; residual / prenorm / residual_in_fp32; weight dtypes and
offset; the chunked and column-slab kernel paths at the launcher; layers and their state dicts;
bad input."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_fused.kernels.triton import norm as triton_norm
from paddlenlp_fused.layers.norm import FusedLayerNorm, FusedRMSNorm, GatedRMSNorm
from paddlenlp_fused.ops.norm import layer_norm_fn, rms_norm_fn, rmsnorm_gated_fn
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import assert_close
from helpers import DTYPES, as_leaf64, randn, to64

BACKENDS = ["triton", "reference"]


def _rms64(h, eps):
    return h * paddle.rsqrt((h * h).mean(axis=-1, keepdim=True) + eps)


def _check_grads(name, got, ref, dtype):
    for label, g, r in zip(("dx", "dweight", "dbias", "dresidual", "dz"), got, ref):
        if r is not None:
            assert_close(f"{name} {label}", to64(g), r.numpy(), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 1), (7, 33), (2, 3, 64)], ids=str)
def test_layer_norm_matches_paddle_float64(shape, dtype, backend):
    N = shape[-1]
    x = randn(shape, dtype, requires_grad=True)
    w = randn((N,), dtype, requires_grad=True)
    b = randn((N,), dtype, requires_grad=True)
    y = layer_norm_fn(x, w, b, eps=1e-5, backend=backend)
    assert y.dtype == x.dtype and list(y.shape) == list(shape)
    dy = randn(shape, dtype)
    grads = paddle.grad(y, [x, w, b], dy)

    x64, w64, b64 = as_leaf64(x), as_leaf64(w), as_leaf64(b)
    y64 = F.layer_norm(x64, N, weight=w64, bias=b64, epsilon=1e-5)
    ref = paddle.grad(y64, [x64, w64, b64], paddle.to_tensor(to64(dy)))
    assert_close("layer_norm y", to64(y), y64.numpy(), dtype)
    _check_grads("layer_norm", grads, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("weight_offset", [0.0, 1.0])
@pytest.mark.parametrize("dtype,weight_dtype", [("float32", "float32"), ("float16", "float16"),
                                                ("bfloat16", "bfloat16"), ("bfloat16", "float32")])
def test_rms_norm_matches_float64(dtype, weight_dtype, weight_offset, backend):
    x = randn((6, 45), dtype, requires_grad=True)
    w = randn((45,), weight_dtype, requires_grad=True)
    y = rms_norm_fn(x, w, eps=1e-6, weight_offset=weight_offset, backend=backend)
    dy = randn(y.shape, dtype)
    grads = paddle.grad(y, [x, w], dy)
    assert grads[1].dtype == w.dtype

    x64, w64 = as_leaf64(x), as_leaf64(w)
    y64 = _rms64(x64, 1e-6) * (w64 + weight_offset)
    ref = paddle.grad(y64, [x64, w64], paddle.to_tensor(to64(dy)))
    assert_close("rms_norm y", to64(y), y64.numpy(), dtype)
    _check_grads("rms_norm", grads, ref, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype,residual_dtype,residual_in_fp32", [
    ("float32", "float32", False), ("bfloat16", "bfloat16", False), ("bfloat16", "bfloat16", True),
    ("float16", "float32", False)])
def test_residual_prenorm_values_and_all_gradients(dtype, residual_dtype, residual_in_fp32, is_rms_norm, backend):
    """h = x + residual (rounded to the stream's dtype) is normalised and returned; the loss uses
    both outputs, so gradients reach x and residual through y and through h."""
    shape, N = (5, 40), 40
    x = randn(shape, dtype, requires_grad=True)
    res = randn(shape, residual_dtype, requires_grad=True)
    w = randn((N,), "float32", requires_grad=True)
    b = None if is_rms_norm else randn((N,), "float32", requires_grad=True)
    y, h = layer_norm_fn(x, w, b, res, eps=1e-5, prenorm=True, residual_in_fp32=residual_in_fp32,
                         is_rms_norm=is_rms_norm, backend=backend)
    h_dtype = "float32" if residual_in_fp32 else residual_dtype
    assert y.dtype == x.dtype and str(h.dtype).endswith(h_dtype)
    dy, dh = randn(shape, dtype), randn(shape, h_dtype)
    inputs = [x, w] + ([b] if b is not None else []) + [res]
    grads = paddle.grad([y, h], inputs, [dy, dh])

    x64, w64, r64 = as_leaf64(x), as_leaf64(w), as_leaf64(res)
    exact = x64 + r64
    rounded = paddle.to_tensor(to64((x.astype("float32") + res.astype("float32")).astype(h_dtype)))
    h64 = exact + (rounded - exact).detach()  # the stream's rounding, with the identity's gradient
    if is_rms_norm:
        y64 = _rms64(h64, 1e-5) * w64
    else:
        b64 = as_leaf64(b)
        y64 = F.layer_norm(h64, N, weight=w64, bias=b64, epsilon=1e-5)
    leaves = [x64, w64] + ([b64] if b is not None else []) + [r64]
    ref = paddle.grad([y64, h64], leaves, [paddle.to_tensor(to64(dy)), paddle.to_tensor(to64(dh))])
    assert_close("prenorm y", to64(y), y64.numpy(), dtype)
    assert_close("prenorm h", to64(h), h64.numpy(), h_dtype)
    ref = list(ref)
    labels = ["dx", "dweight"] + (["dbias"] if b is not None else []) + ["dresidual"]
    for label, g, r in zip(labels, grads, ref):
        assert_close(f"prenorm {label}", to64(g), r.numpy(), dtype)
    assert grads[-1].dtype == res.dtype


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("residual_in_fp32", [False, True])
def test_prenorm_without_residual_returns_the_stream(residual_in_fp32, backend):
    x = randn((4, 24), "bfloat16", requires_grad=True)
    w = randn((24,), "bfloat16", requires_grad=True)
    y, h = rms_norm_fn(x, w, prenorm=True, residual_in_fp32=residual_in_fp32, backend=backend)
    assert str(h.dtype).endswith("float32" if residual_in_fp32 else "bfloat16")
    np.testing.assert_array_equal(to64(h), to64(x))
    dy = randn(y.shape, "bfloat16")
    # (paddle.grad must ask for every differentiable leaf of a PyLayer: Paddle's partial grad
    # rejects a PyLayer gradient for a leaf it was not asked for)
    dx, dw = paddle.grad([y, h], [x, w], [dy, paddle.ones(h.shape, h.dtype)])
    x64, w64 = as_leaf64(x), as_leaf64(w)
    dx64, dw64 = paddle.grad([_rms64(x64, 1e-6) * w64, x64], [x64, w64],
                             [paddle.to_tensor(to64(dy)), paddle.ones(x64.shape, "float64")])
    assert_close("prenorm-only dx", to64(dx), dx64.numpy(), "bfloat16")
    assert_close("prenorm-only dweight", to64(dw), dw64.numpy(), "bfloat16")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("group_size,norm_before_gate,gated", [
    (None, True, True), (16, True, True), (16, False, True), (None, False, True), (8, True, False)])
def test_gated_rms_norm_matches_float64(group_size, norm_before_gate, gated, dtype, backend):
    shape, N = (3, 2, 48), 48
    x = randn(shape, dtype, requires_grad=True)
    z = randn(shape, dtype, requires_grad=True) if gated else None
    w = randn((N,), dtype, requires_grad=True)
    y = rmsnorm_gated_fn(x, w, z, eps=1e-6, group_size=group_size, norm_before_gate=norm_before_gate,
                         backend=backend)
    dy = randn(shape, dtype)
    inputs = [x, w] + ([z] if gated else [])
    grads = paddle.grad(y, inputs, dy)

    x64, w64 = as_leaf64(x), as_leaf64(w)
    z64 = as_leaf64(z) if gated else None
    h = x64 * F.silu(z64) if gated and not norm_before_gate else x64
    g = group_size or N
    y64 = _rms64(h.reshape([3, 2, N // g, g]), 1e-6).reshape(list(shape)) * w64
    if gated and norm_before_gate:
        y64 = y64 * F.silu(z64)
    ref = paddle.grad(y64, [x64, w64] + ([z64] if gated else []), paddle.to_tensor(to64(dy)))
    assert_close("gated y", to64(y), y64.numpy(), dtype)
    for label, gr, r in zip(("dx", "dweight", "dz"), grads, ref):
        assert_close(f"gated {label}", to64(gr), r.numpy(), dtype)


def _np_norm_grads(h, w, b, dy, eps, is_rms):
    """float64 forward and backward of a norm over the last axis (numpy)."""
    mean = 0.0 if is_rms else h.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt(((h - mean) ** 2).mean(-1, keepdims=True) + eps)
    xhat = (h - mean) * rstd
    y = xhat * w + (0.0 if b is None else b)
    wdy = dy * w
    c1 = (xhat * wdy).mean(-1, keepdims=True)
    c2 = 0.0 if is_rms else wdy.mean(-1, keepdims=True)
    return y, (wdy - xhat * c1 - c2) * rstd, (dy * xhat).sum(0), dy.sum(0)


@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_chunked_forward_and_sliced_backward_paths(is_rms_norm):
    """Groups wider than the register tile: the forward's chunk loops and the backward's column slabs
    with the row-statistics pre-pass (max_block=16 for 40 columns); rows at a stride (a column
    slice of a wider buffer), outputs poisoned with NaN."""
    M, N = 9, 40
    x = randn((M, N + 8), "float32")[:, 4:N + 4]
    res = randn((M, N), "float32")
    w, b = randn((N,), "float32"), randn((N,), "float32")
    nan = lambda *s: paddle.full(list(s), float("nan"), dtype="float32")  # noqa: E731
    y, res_out, mean, rstd = nan(M, N), nan(M, N), nan(M), nan(M)
    triton_norm.norm_fwd(*triton_args(x, w, None if is_rms_norm else b, y, mean, rstd),
                         residual=triton_args(res)[0], residual_out=triton_args(res_out)[0], eps=1e-5,
                         is_rms_norm=is_rms_norm, max_block=16)
    h = to64(x) + to64(res)
    dy = randn((M, N), "float32")
    bias64 = None if is_rms_norm else to64(b)
    y64, dx64, dw64, db64 = _np_norm_grads(h, to64(w), bias64, to64(dy), 1e-5, is_rms_norm)
    assert_close("chunked y", to64(y), y64, "float32")
    np.testing.assert_allclose(to64(res_out), h, rtol=1e-6)

    partials_shape, rowstats_shape = triton_norm.bwd_workspace_shapes(M, N, not is_rms_norm, max_block=16)
    assert rowstats_shape == (M, 2)
    dx, dw, db = nan(M, N), nan(N), None if is_rms_norm else nan(N)
    ws = triton_args(nan(*partials_shape), nan(*rowstats_shape))
    triton_norm.norm_bwd(*triton_args(res_out, w, None if is_rms_norm else mean, rstd, dy, dx, dw), ws[0],
                         dbias=triton_args(db)[0], rowstats=ws[1], is_rms_norm=is_rms_norm, max_block=16)
    assert_close("sliced dx", to64(dx), dx64, "float32")
    assert_close("sliced dweight", to64(dw), dw64, "float32")
    if not is_rms_norm:
        assert_close("sliced dbias", to64(db), db64, "float32")


def test_gated_chunked_path_matches_reference():
    x = randn((5, 64), "float32", requires_grad=True)
    z = randn((5, 64), "float32")
    w = randn((64,), "float32")
    y = paddle.full([5, 64], float("nan"), dtype="float32")
    rstd = paddle.full([10], float("nan"), dtype="float32")
    triton_norm.norm_fwd(*triton_args(x, w, None, y, None, rstd), z=triton_args(z)[0], is_rms_norm=True,
                         eps=1e-6, group_size=32, norm_before_gate=False, max_block=8)
    ref = paddle.to_tensor(to64(x) / (1 + np.exp(-to64(z))) * to64(z))
    ref64 = _rms64(ref.reshape([5, 2, 32]), 1e-6).reshape([5, 64]) * paddle.to_tensor(to64(w))
    assert_close("gated chunked y", to64(y), ref64.numpy(), "float32")


def test_fused_layer_norm_state_dict_and_output_match_paddle_layer_norm():
    ours, theirs = FusedLayerNorm([4, 6], epsilon=1e-5), paddle.nn.LayerNorm([4, 6], epsilon=1e-5)
    assert sorted(ours.state_dict()) == sorted(theirs.state_dict()) == ["bias", "weight"]
    theirs.weight.set_value(randn((24,)))
    theirs.bias.set_value(randn((24,)))
    ours.set_state_dict(theirs.state_dict())
    x = randn((3, 4, 6))
    np.testing.assert_allclose(ours(x).numpy(), theirs(x).numpy(), rtol=1e-5, atol=1e-5)
    theirs.set_state_dict(FusedLayerNorm([4, 6]).state_dict())  # and back
    np.testing.assert_array_equal(theirs.weight.numpy(), np.ones(24, np.float32))

    plain = FusedLayerNorm(6, weight_attr=False, bias_attr=False)
    assert plain.state_dict().keys() == paddle.nn.LayerNorm(6, weight_attr=False, bias_attr=False).state_dict().keys()
    x = randn((5, 6))
    np.testing.assert_allclose(plain(x).numpy(), F.layer_norm(x, 6).numpy(), rtol=1e-5, atol=1e-5)


def test_layers_residual_forward_sequence_parallel_and_names():
    ln = FusedLayerNorm(16, sequence_parallel=True, residual_in_fp32=True)
    assert ln.weight.sequence_parallel and ln.bias.sequence_parallel
    x, res = randn((2, 3, 16), "bfloat16"), randn((2, 3, 16), "bfloat16")
    out, h = ln(x, res)
    assert out.dtype == paddle.bfloat16 and h.dtype == paddle.float32 and list(h.shape) == [2, 3, 16]

    rms = FusedRMSNorm(16, weight_offset=1.0, sequence_parallel=True)
    assert list(rms.state_dict()) == ["weight"] and rms.weight.sequence_parallel
    np.testing.assert_array_equal(rms.weight.numpy(), np.zeros(16, np.float32))  # Gemma: scale 1 + 0
    x = randn((3, 16))
    x64 = paddle.to_tensor(to64(x))
    assert_close("FusedRMSNorm", to64(rms(x)), _rms64(x64, 1e-6).numpy(), "float32")

    gated = GatedRMSNorm(16, group_size=8, norm_before_gate=False)
    assert list(gated.state_dict()) == ["weight"] and not getattr(gated.weight, "sequence_parallel", False)
    z = randn((3, 16))
    ref = rmsnorm_gated_fn(x, gated.weight, z, group_size=8, norm_before_gate=False, backend="reference")
    np.testing.assert_allclose(gated(x, z).numpy(), ref.numpy(), rtol=1e-5, atol=1e-6)


def test_bad_input_raises_clear_errors():
    x, w = randn((3, 8)), randn((8,))
    with pytest.raises(ValueError, match=r"weight: expected shape \[8\]"):
        layer_norm_fn(x, randn((7,)), None)
    with pytest.raises(ValueError, match=r"bias: expected shape \[8\]"):
        layer_norm_fn(x, w, randn((4,)))
    with pytest.raises(ValueError, match="residual: expected x's shape"):
        rms_norm_fn(x, w, residual=randn((3, 4)))
    with pytest.raises(TypeError, match="x: expected dtype"):
        rms_norm_fn(paddle.ones([3, 8], dtype="int32"), w)
    with pytest.raises(TypeError, match="weight: expected dtype"):
        rms_norm_fn(x, paddle.ones([8], dtype="int64"))
    with pytest.raises(TypeError, match="weight: expected float32 or x's dtype"):
        rms_norm_fn(randn((3, 8), "float16"), randn((8,), "bfloat16"))
    with pytest.raises(TypeError, match="residual: expected a paddle.Tensor"):
        rms_norm_fn(x, w, residual=np.ones((3, 8), np.float32))
    with pytest.raises(ValueError, match="group_size: expected a positive divisor"):
        rmsnorm_gated_fn(x, w, group_size=3)
    with pytest.raises(ValueError, match="z: expected x's shape"):
        rmsnorm_gated_fn(x, w, z=randn((3, 4)))
    with pytest.raises(ValueError, match="trailing axes"):
        FusedLayerNorm(6)(x)
    with pytest.raises(ValueError, match="backend"):
        layer_norm_fn(x, w, None, backend="cudnn")
    # the Triton backward's workspace of counters (fused partial sums)
    stats, partials = paddle.zeros([3]), paddle.zeros([1, 2, 8])
    launch = triton_args(x, w, stats, stats, x, paddle.empty([3, 8]), paddle.empty([8]), partials)
    with pytest.raises(TypeError, match="counters: expected int32"):
        triton_norm.norm_bwd(*launch, counters=triton_args(paddle.zeros([2], dtype="float32"))[0])
    with pytest.raises(ValueError, match=r"counters: expected shape \(2,\)"):
        triton_norm.norm_bwd(*launch, counters=triton_args(paddle.zeros([3], dtype="int32"))[0])


def _grads_with_other_consumers(norm, x0, r0, g):
    """Gradients of x0 and r0 when each also feeds another branch, computed before the norm so that
    Paddle adds that branch's gradient into what the norm returns (in place)."""
    x, r = x0 * 1.0, r0 * 1.0
    x32, r32 = x.astype("float32"), r.astype("float32")
    other = 3.0 * paddle.tanh(x32).sum() + 5.0 * (r32 * r32).sum()
    out = norm(x, r)
    out = out[0] if isinstance(out, tuple) else out
    ((out.astype("float32") * g).sum() + other).backward()
    grads = to64(x0.grad), to64(r0.grad)
    x0.clear_gradient()
    r0.clear_gradient()
    return grads


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,residual_dtype", [("float32", "float32"), ("bfloat16", "bfloat16"),
                                                  ("bfloat16", "float32")])
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
def test_residual_gradients_are_distinct_tensors(is_rms_norm, dtype, residual_dtype, backend):
    """x and residual each get their own gradient tensor: x's other consumer must not leak into the
    residual's gradient nor the residual's into x's (they shared one buffer)."""
    x0, r0 = randn((5, 24), dtype, requires_grad=True), randn((5, 24), residual_dtype, requires_grad=True)
    w, b = randn((24,)), (None if is_rms_norm else randn((24,)))
    g = randn((5, 24))
    got = _grads_with_other_consumers(
        lambda x, r: layer_norm_fn(x, w, b, r, prenorm=True, is_rms_norm=is_rms_norm, backend=backend), x0, r0, g)
    ref = _grads_with_other_consumers(
        lambda x, r: layer_norm_fn(x, w, b, r, prenorm=True, is_rms_norm=is_rms_norm, backend="reference"), x0, r0, g)
    for name, a, e in zip(("x", "residual"), got, ref):
        assert_close(f"{name}.grad", a, e, dtype)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -1e-6])
def test_non_finite_or_negative_eps_is_rejected(bad):
    x, w = randn((3, 8)), randn((8,))
    for call in (lambda: layer_norm_fn(x, w, None, eps=bad), lambda: rms_norm_fn(x, w, eps=bad, backend="reference"),
                 lambda: rmsnorm_gated_fn(x, w, eps=bad), lambda: FusedRMSNorm(8, epsilon=bad),
                 lambda: FusedLayerNorm(8, epsilon=bad), lambda: GatedRMSNorm(8, epsilon=bad)):
        with pytest.raises(ValueError, match="eps.*finite float >= 0"):
            call()
    with pytest.raises(TypeError, match="eps: expected a float"):
        rms_norm_fn(x, w, eps="1e-6")
