"""LayerNorm / RMSNorm / gated RMSNorm: Triton kernels (interpreter) and the reference against
float64 (``paddle.nn.functional.layer_norm`` or a float64 composition), values and the gradients of
every input, through the Paddle ops; residual / prenorm / residual_in_fp32; weight dtypes and
offset; the chunked and column-slab kernel paths at the launcher; layers and their state dicts;
bad input; flash-attn's second output (weight1, bias1) and preallocated outputs (out, residual_out)."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_fused.kernels.triton import norm as triton_norm
from paddlenlp_fused.layers.norm import FusedLayerNorm, FusedRMSNorm, GatedRMSNorm
from paddlenlp_fused.ops.norm import layer_norm_fn, rms_norm_fn, rmsnorm_gated_fn
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.runtime import backend as runtime_backend
from paddlenlp_fused.testing.numerics import assert_close, assert_close_to_terms, assert_sum_close
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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", ["frozen weight", "frozen bias", "frozen both", "dx alone"])
def test_layer_norm_reference_dx_with_frozen_parameters_matches_float64(case, dtype):
    """The weight and bias still scale / shift dx where their gradients are not computed (Paddle
    3.3's CPU layer_norm_grad leaves a weight whose gradient is not asked for out of x's gradient;
    the float64 side is a composition)."""
    N = 40
    x = randn((6, N), dtype, requires_grad=True)
    w = randn((N,), dtype, requires_grad=case in ("frozen bias", "dx alone"))
    b = randn((N,), dtype, requires_grad=case in ("frozen weight", "dx alone"))
    y = layer_norm_fn(x, w, b, eps=1e-5, backend="reference")
    dy = randn(y.shape, dtype)
    if case == "dx alone":
        (dx,) = paddle.grad(y, [x], dy)
    else:
        (y.astype("float32") * dy.astype("float32")).sum().backward()
        dx = x.grad

    x64 = as_leaf64(x)
    centred = x64 - x64.mean(axis=-1, keepdim=True)
    y64 = centred * paddle.rsqrt((centred * centred).mean(axis=-1, keepdim=True) + 1e-5) * to64(w) + to64(b)
    (dx64,) = paddle.grad(y64, [x64], paddle.to_tensor(to64(dy)))
    assert_close("layer_norm y", to64(y), y64.numpy(), dtype)
    assert_close("layer_norm dx", to64(dx), dx64.numpy(), dtype)


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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("is_rms_norm,norm_before_gate,group_size,with_bias", [
    (False, True, None, True), (False, False, 16, True), (True, True, 16, True), (True, False, None, True),
    (False, True, 8, False)])
def test_gated_norm_bias_and_layer_norm_match_float64(is_rms_norm, norm_before_gate, group_size, with_bias, dtype,
                                                      backend):
    """mamba_ssm's layernorm_gated: bias, and LayerNorm (is_rms_norm=False), values and every
    gradient (dz includes bias * silu'(z) when the gate comes after the norm)."""
    shape, N = (5, 48), 48
    x, z = randn(shape, dtype, requires_grad=True), randn(shape, dtype, requires_grad=True)
    w = randn((N,), dtype, requires_grad=True)
    b = randn((N,), dtype, requires_grad=True) if with_bias else None
    y = rmsnorm_gated_fn(x, w, z, eps=1e-5, group_size=group_size, norm_before_gate=norm_before_gate,
                         backend=backend, bias=b, is_rms_norm=is_rms_norm)
    dy = randn(shape, dtype)
    inputs = [x, w, z] + ([b] if with_bias else [])
    grads = paddle.grad(y, inputs, dy)

    x64, w64, z64 = as_leaf64(x), as_leaf64(w), as_leaf64(z)
    b64 = as_leaf64(b) if with_bias else None
    h = x64 if norm_before_gate else x64 * F.silu(z64)
    g = group_size or N
    hg = h.reshape([5, N // g, g])
    if not is_rms_norm:
        hg = hg - hg.mean(axis=-1, keepdim=True)
    y64 = _rms64(hg, 1e-5).reshape(list(shape)) * w64
    if with_bias:
        y64 = y64 + b64
    if norm_before_gate:
        y64 = y64 * F.silu(z64)
    ref = paddle.grad(y64, [x64, w64, z64] + ([b64] if with_bias else []), paddle.to_tensor(to64(dy)))
    assert_close("gated y", to64(y), y64.numpy(), dtype)
    for label, gr, r in zip(("dx", "dweight", "dz", "dbias"), grads, ref):
        assert_close(f"gated {label}", to64(gr), r.numpy(), dtype)


def test_gated_norm_layer_bias_and_layer_norm():
    layer = GatedRMSNorm(16, group_size=8, bias_attr=None, is_rms_norm=False, backend="triton")
    assert sorted(layer.state_dict()) == ["bias", "weight"]
    layer.bias.set_value(randn((16,)))
    x, z = randn((3, 16)), randn((3, 16))
    ref = rmsnorm_gated_fn(x, layer.weight, z, group_size=8, backend="reference", bias=layer.bias, is_rms_norm=False)
    assert_close("GatedRMSNorm(bias, layer norm)", to64(layer(x, z)), to64(ref), "float32")
    assert sorted(GatedRMSNorm(16).state_dict()) == ["weight"]


def _dropped64(t64, mask, p):
    return t64 if mask is None else t64 * paddle.to_tensor(mask.numpy().astype(np.float64) / (1 - p))


_EXTRAS = {  # flash-attn's options beyond residual/prenorm, one combination each
    "rowscale": dict(rowscale=True),
    "dropout": dict(dropout_p=0.25),
    "rowscale+dropout+residual": dict(rowscale=True, dropout_p=0.1, residual=True),
    "x1+weight1+bias1+dropout+residual": dict(x1=True, weight1=True, dropout_p=0.2, residual=True),
    "weight1 only": dict(weight1=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("extras", list(_EXTRAS))
def test_flash_attn_extras_match_float64(extras, dtype, is_rms_norm, backend):
    """h = dropout(x * rowscale) + dropout(x1) + residual, y = norm(h) * w + b, y1 = norm(h) * w1 +
    b1, prenorm h: values and the gradients of every input (rowscale too) against float64 with the
    returned keep-masks; the masks drop about dropout_p and are reproducible from the seed."""
    opts = _EXTRAS[extras]
    shape, N, p = (4, 9, 37), 37, opts.get("dropout_p", 0.0)
    x = randn(shape, dtype, requires_grad=True)
    w, b = randn((N,), "float32", requires_grad=True), randn((N,), "float32", requires_grad=True)
    res = randn(shape, dtype, requires_grad=True) if opts.get("residual") else None
    x1 = randn(shape, dtype, requires_grad=True) if opts.get("x1") else None
    w1 = randn((N,), "float32", requires_grad=True) if opts.get("weight1") else None
    b1 = randn((N,), "float32", requires_grad=True) if opts.get("weight1") else None
    rs = paddle.to_tensor(np.random.rand(*shape[:-1]).astype(np.float32) + 0.5).astype(dtype) \
        if opts.get("rowscale") else None
    if rs is not None:
        rs.stop_gradient = False
    fn = rms_norm_fn if is_rms_norm else layer_norm_fn
    kwargs = dict(residual=res, x1=x1, weight1=w1, bias1=b1, eps=1e-5, dropout_p=p, rowscale=rs,
                  prenorm=True, return_dropout_mask=True, seed=1234, backend=backend)
    outs = fn(x, w, b, **kwargs)
    *ys, h, m, m1 = outs
    assert len(ys) == (2 if w1 is not None else 1) and all(y.dtype == x.dtype for y in ys)
    assert (m is None) == (p == 0) and (m1 is None) == (p == 0 or x1 is None)
    if m is not None:
        assert str(m.dtype).endswith("bool") and list(m.shape) == list(shape)
        assert abs(1 - m.astype("float32").mean().item() - p) < 0.1
        again = fn(x, w, b, **kwargs)
        np.testing.assert_array_equal(again[-2].numpy(), m.numpy())
        assert m1 is None or not np.array_equal(m1.numpy(), m.numpy())
    leaves = [t for t in (x, w, b, res, x1, w1, b1, rs) if t is not None]
    cots = [randn(shape, dtype) for _ in ys] + [randn(shape, str(h.dtype).split(".")[-1])]
    grads = paddle.grad(ys + [h], leaves, cots)

    x64, w64, b64 = as_leaf64(x), as_leaf64(w), as_leaf64(b)
    leaves64 = [x64, w64, b64]
    t = x64
    if rs is not None:
        rs64 = as_leaf64(rs)
        t = t * rs64.unsqueeze(-1)
    exact = _dropped64(t, m, p)
    if x1 is not None:
        x164 = as_leaf64(x1)
        exact = exact + _dropped64(x164, m1, p)
    if res is not None:
        r64 = as_leaf64(res)
        exact = exact + r64
    h64 = exact + (paddle.to_tensor(to64(h)) - exact).detach()  # the stream's rounding
    hn = h64 if is_rms_norm else h64 - h64.mean(axis=-1, keepdim=True)
    normed = _rms64(hn, 1e-5)
    ys64 = [normed * w64 + b64]
    if w1 is not None:
        w164, b164 = as_leaf64(w1), as_leaf64(b1)
        ys64.append(normed * w164 + b164)
    leaves64 += [r64] if res is not None else []
    leaves64 += [x164] if x1 is not None else []
    leaves64 += [w164, b164] if w1 is not None else []
    leaves64 += [rs64] if rs is not None else []
    ref = paddle.grad(ys64 + [h64], leaves64, [paddle.to_tensor(to64(c)) for c in cots])
    for i, (y, y64) in enumerate(zip(ys, ys64)):
        assert_close(f"{extras} y{i}", to64(y), y64.numpy(), dtype)
    assert_close(f"{extras} h", to64(h), exact.numpy(), dtype)
    names = ["x", "weight", "bias", "residual", "x1", "weight1", "bias1", "rowscale"]
    names = [n for n, t in zip(names, (x, w, b, res, x1, w1, b1, rs)) if t is not None]
    for name, g, r in zip(names, grads, ref):
        if name == "rowscale":  # a row's sum of x * dt over the channels, which cancels: DESIGN.md's measure for sums
            terms = (np.abs(to64(x)) * np.abs(ref[0].numpy())).sum(-1) / to64(rs)  # |dt| = |dx| / rowscale
            assert_sum_close(f"{extras} d{name}", to64(g), r.numpy(), terms, dtype)
        else:
            assert_close(f"{extras} d{name}", to64(g), r.numpy(), dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_flash_attn_extras_seeds(backend):
    """The dropout mask is a function of the seed, or of paddle.seed without one; the gradient uses
    the forward's mask."""
    x, w = randn((3, 8)), randn((8,))
    y = layer_norm_fn(x, w, None, dropout_p=0.5, seed=7, backend=backend)
    np.testing.assert_array_equal(y.numpy(), layer_norm_fn(x, w, None, dropout_p=0.5, seed=7, backend=backend).numpy())
    assert not np.array_equal(y.numpy(), layer_norm_fn(x, w, None, dropout_p=0.5, seed=8, backend=backend).numpy())
    paddle.seed(11)
    first = layer_norm_fn(x, w, None, dropout_p=0.5, return_dropout_mask=True, backend=backend)[1].numpy()
    paddle.seed(11)
    again = layer_norm_fn(x, w, None, dropout_p=0.5, return_dropout_mask=True, backend=backend)[1].numpy()
    np.testing.assert_array_equal(first, again)
    # dropped elements get no gradient: the backward regenerates the forward's mask
    xg = randn((64, 8), requires_grad=True)
    y, mask, _ = layer_norm_fn(xg, w, None, dropout_p=0.5, seed=3, return_dropout_mask=True, backend=backend)
    (dx,) = paddle.grad(y, [xg], paddle.ones_like(y))
    assert np.all(dx.numpy()[~mask.numpy()] == 0) and np.any(dx.numpy()[mask.numpy()] != 0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype,weight_dtype,out_dtype", [
    ("bfloat16", "float32", "float32"), ("float32", "bfloat16", "bfloat16"), ("float16", "bfloat16", None),
    ("bfloat16", "float16", "float16")])
def test_out_dtype_and_any_weight_dtype(dtype, weight_dtype, out_dtype, backend):
    shape, N = (6, 45), 45
    x, res = randn(shape, dtype, requires_grad=True), randn(shape, dtype, requires_grad=True)
    w, b = randn((N,), weight_dtype, requires_grad=True), randn((N,), weight_dtype, requires_grad=True)
    y, h = layer_norm_fn(x, w, b, res, prenorm=True, out_dtype=out_dtype, zero_centered_weight=True, backend=backend)
    assert str(y.dtype).endswith(out_dtype or dtype)
    dy = randn(shape, out_dtype or dtype)
    grads = paddle.grad([y], [x, w, b, res], [dy])
    assert grads[0].dtype == x.dtype and grads[1].dtype == w.dtype
    x64, w64, b64, r64 = as_leaf64(x), as_leaf64(w), as_leaf64(b), as_leaf64(res)
    exact = x64 + r64
    h64 = exact + (paddle.to_tensor(to64(h)) - exact).detach()
    y64 = F.layer_norm(h64, N, weight=w64 + 1.0, bias=b64, epsilon=1e-5)
    ref = paddle.grad([y64], [x64, w64, b64, r64], [paddle.to_tensor(to64(dy))])
    loosest = "bfloat16" if "bfloat16" in (dtype, weight_dtype, out_dtype) else "float16"
    assert_close("out_dtype y", to64(y), y64.numpy(), loosest)
    for label, g, r in zip(("dx", "dweight", "dbias", "dresidual"), grads, ref):
        assert_close(f"out_dtype {label}", to64(g), r.numpy(), loosest)


@pytest.mark.parametrize("case", ["rowscale+dropout+residual", "x1+dropout"])
def test_triton_extras_chunked_and_slab_paths(case):
    """The extras through the chunked forward and the column-slab backward (register blocks of 8
    columns) equal the op's single-block kernels: the keep-mask is a function of the element, not
    of the tiling; drowscale is summed over the slabs."""
    M, N, p, seed = 5, 37, 0.3, 99
    x, res, w, b, dy = randn((M, N)), randn((M, N)), randn((N,)), randn((N,)), randn((M, N))
    x1 = randn((M, N)) if case.startswith("x1") else None
    rs = None if x1 is not None else paddle.to_tensor(np.random.rand(M).astype(np.float32) + 0.5)
    leaves = [t for t in (x, w, b, res, x1, rs) if t is not None]
    for t in leaves:
        t.stop_gradient = False
    y_op, h_op, m_op, m1_op = layer_norm_fn(x, w, b, res, x1, rowscale=rs, dropout_p=p, seed=seed, prenorm=True,
                                            return_dropout_mask=True, backend="triton")
    want = paddle.grad([y_op], leaves, [dy])

    nan = lambda *shape, dtype="float32": paddle.full(list(shape), float("nan"), dtype=dtype)  # noqa: E731
    y, h, mean, rstd, dx, dw, db, dres = nan(M, N), nan(M, N), nan(M), nan(M), nan(M, N), nan(N), nan(N), nan(M, N)
    mask, mask1 = paddle.full([M, N], 7, dtype="uint8"), None if x1 is None else paddle.full([M, N], 7, dtype="uint8")
    triton_norm.norm_fwd(*triton_args(x, w, b, y, mean, rstd), **dict(zip(
        ("residual", "residual_out", "x1", "rowscale", "dropout_mask", "dropout_mask1"),
        triton_args(res, h, x1, rs, mask, mask1))), dropout_p=p, seed=seed, max_block=8)
    np.testing.assert_array_equal(mask.numpy().astype(bool), m_op.numpy())
    if x1 is not None:
        np.testing.assert_array_equal(mask1.numpy().astype(bool), m1_op.numpy())
    assert_close("chunked y", to64(y), to64(y_op), "float32")
    assert_close("chunked h", to64(h), to64(h_op), "float32")
    partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, True, max_block=8)
    dx1 = None if x1 is None else nan(M, N)
    drs = None if rs is None else nan(*triton_norm.drowscale_shape(M, N, max_block=8))
    assert drs is None or drs.shape[1] > 1  # the slab path
    triton_norm.norm_bwd(*triton_args(h, w, mean, rstd, dy, dx, dw, nan(*partials)), **dict(zip(
        ("dbias", "dresidual", "rowstats", "x", "dx1", "rowscale", "drowscale"),
        triton_args(db, dres, nan(*rowstats), None if rs is None else x, dx1, rs, drs))),
        dropout_p=p, seed=seed, max_block=8)
    got = [dx, dw, db, dres] + ([dx1] if x1 is not None else []) + ([drs.sum(axis=-1)] if rs is not None else [])
    for name, g, r in zip(("dx", "dweight", "dbias", "dresidual", "dx1/drowscale"), got, want):
        assert_close(f"chunked {name}", to64(g), to64(r), "float32")


def test_rms_norm_fn_takes_bias_third_as_flash_attn():
    x, w, b = randn((4, 16)), randn((16,)), randn((16,))
    for backend in BACKENDS:
        y = rms_norm_fn(x, w, b, backend=backend)
        x64 = paddle.to_tensor(to64(x))
        assert_close("rms_norm_fn(x, w, b)", to64(y), (_rms64(x64, 1e-6) * to64(w) + to64(b)).numpy(), "float32")


def test_flash_attn_extras_bad_input():
    x, w = randn((3, 8)), randn((8,))
    cases = [
        (ValueError, "x1: expected x's shape", dict(x1=randn((3, 4)))),
        (ValueError, "rowscale: not supported together with x1", dict(x1=randn((3, 8)), rowscale=randn((3,)))),
        (ValueError, "rowscale: expected x's leading shape", dict(rowscale=randn((8,)))),
        (TypeError, "rowscale: expected dtype", dict(rowscale=paddle.ones([3], dtype="int32"))),
        (ValueError, "weight1: expected shape", dict(weight1=randn((4,)))),
        (TypeError, "weight1: expected weight's dtype", dict(weight1=randn((8,), "bfloat16"))),
        (ValueError, "bias1: given without weight1", dict(bias1=randn((8,)))),
        (ValueError, "dropout_p: expected a number in", dict(dropout_p=1.0)),
        (ValueError, "dropout_p: expected a number in", dict(dropout_p=-0.1)),
        (TypeError, "seed: expected None or an int", dict(seed=1.5)),
        (ValueError, r"seed: expected an int in \[0, 2\*\*62\)", dict(seed=-1)),
        (TypeError, "out_dtype: expected None or one of", dict(out_dtype="int32")),
        (ValueError, "zero_centered_weight", dict(zero_centered_weight=True, weight_offset=0.5)),
    ]
    for backend in BACKENDS:
        for error, message, kwargs in cases:
            with pytest.raises(error, match=message):
                layer_norm_fn(x, w, None, backend=backend, **kwargs)
    for backend in BACKENDS:
        with pytest.raises(TypeError, match="bias: expected weight's dtype"):
            rmsnorm_gated_fn(x, w, backend=backend, bias=randn((8,), "float16"))
        with pytest.raises(ValueError, match=r"bias: expected shape \[8\]"):
            rmsnorm_gated_fn(x, w, backend=backend, bias=randn((4,)))


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


@pytest.mark.parametrize("norm_before_gate", [True, False])
def test_gated_layer_norm_bias_chunked_and_slab_paths(norm_before_gate):
    """The gated LayerNorm with bias through the chunked forward and the column-slab backward (a
    register block of 8 columns for groups of 32) against the float64 values of the reference's
    autograd; the launcher's dz leaves out bias * silu'(z) with the gate after the norm."""
    M, N, G = 5, 64, 32
    x, z, w, b, dy = (randn((M, N), "float32", requires_grad=True), randn((M, N), "float32", requires_grad=True),
                      randn((N,), "float32", requires_grad=True), randn((N,), "float32", requires_grad=True),
                      randn((M, N), "float32"))
    nan = lambda *shape: paddle.full(list(shape), float("nan"), dtype="float32")  # noqa: E731
    y, mean, rstd, dx, dz, dw, db = nan(M, N), nan(M * 2), nan(M * 2), nan(M, N), nan(M, N), nan(N), nan(N)
    triton_norm.norm_fwd(*triton_args(x, w, b, y, mean, rstd), z=triton_args(z)[0], eps=1e-6, group_size=G,
                         norm_before_gate=norm_before_gate, max_block=8)
    partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, True, G, max_block=8)
    assert rowstats is not None  # the slab path
    triton_norm.norm_bwd(*triton_args(x, w, mean, rstd, dy, dx, dw, nan(*partials)),
                         **dict(zip(("dbias", "z", "dz", "rowstats"), triton_args(db, z, dz, nan(*rowstats)))),
                         group_size=G, norm_before_gate=norm_before_gate, max_block=8)
    ref = rmsnorm_gated_fn(x, w, z, eps=1e-6, group_size=G, norm_before_gate=norm_before_gate,
                           backend="reference", bias=b, is_rms_norm=False)
    rdx, rdw, rdb, rdz = paddle.grad(ref, [x, w, b, z], dy)
    if norm_before_gate:
        sig = F.sigmoid(z)
        rdz = rdz - dy * b * sig * (1 + z * (1 - sig))
    for label, got, want in (("y", y, ref), ("dx", dx, rdx), ("dweight", dw, rdw), ("dbias", db, rdb),
                             ("dz", dz, rdz)):
        assert_close(f"gated layer norm slabs {label}", to64(got), to64(want), "float32")


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
    with pytest.raises(TypeError, match="bias: expected weight's dtype"):
        rms_norm_fn(x, w, randn((8,), "bfloat16"))
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


# ---- flash-attn's second output (weight1, bias1) and preallocated outputs (out, residual_out) ----------------

_WEIGHTS = ("weight", "bias", "weight1", "bias1")


def _norm64(inputs, h, is_rms_norm, eps=1e-5):
    """float64 leaves of ``inputs`` (name -> tensor or None) and the outputs ([y, y1], h64) of h = x
    + x1 + residual (rounded as the op's ``h``, with the identity's gradient), y = norm(h) * weight +
    bias, y1 = norm(h) * weight1 + bias1."""
    leaves = {name: as_leaf64(t) for name, t in inputs.items() if t is not None}
    exact = leaves["x"]
    for name in ("x1", "residual"):
        if name in leaves:
            exact = exact + leaves[name]
    h64 = exact + (paddle.to_tensor(to64(h)) - exact).detach()
    normed = _rms64(h64 if is_rms_norm else h64 - h64.mean(axis=-1, keepdim=True), eps)
    ys = []
    for w, b in (("weight", "bias"), ("weight1", "bias1")):
        if w in leaves:
            ys.append(normed * leaves[w] + (leaves[b] if b in leaves else 0.0))
    return leaves, ys, h64


def _check_grads64(label, names, grads, refs, dtype, h64, cots, weights, is_rms_norm, cot_h=None, eps=1e-5):
    """Each input's gradient against float64: the weights' (sums over rows) by ``assert_sum_close``
    over their terms' magnitudes; at N = 1 the stream's gradient is all cancellation (LayerNorm: 0
    with rstd = 1 / sqrt(eps); RMSNorm: O(eps), xhat^2 ~ 1), so x's, x1's and residual's are
    measured against the terms that cancel, rstd (|w dy| + |xhat mean(xhat w dy)| + |mean(w dy)|),
    plus |cot_h| (h's cotangent, with prenorm). ``cots``: the cotangents of y (and y1) as float64
    arrays; ``weights``: weight (and weight1) float64 arrays."""
    h = h64.numpy()
    N = h.shape[-1]
    centred = h if is_rms_norm else h - h.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((centred * centred).mean(-1, keepdims=True) + eps)
    xhat = centred * rstd
    by_weight = dict(zip(("weight", "weight1"), zip(weights, cots)))
    for name, g, r in zip(names, grads, refs):
        got, want = to64(g), r.numpy()
        if name in _WEIGHTS:
            dy = by_weight[name.replace("bias", "weight")][1]
            terms = np.abs(dy * xhat if name.startswith("weight") else dy).reshape(-1, N).sum(0)
            assert_sum_close(f"{label} d{name}", got, want, terms, dtype)
        elif name in ("x", "x1", "residual") and N == 1:
            wdy = sum(w * dy for w, dy in by_weight.values())
            terms = rstd * (np.abs(wdy) + np.abs(xhat * (xhat * wdy).mean(-1, keepdims=True)) +
                            (0.0 if is_rms_norm else np.abs(wdy.mean(-1, keepdims=True))))
            assert_close_to_terms(f"{label} d{name}", got, want, terms + (0.0 if cot_h is None else np.abs(cot_h)),
                                  dtype)
        else:
            assert_close(f"{label} d{name}", got, want, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("N", [1, 37, 130, 3000])
@pytest.mark.parametrize("case", ["layer_norm,x1,residual_in_fp32,bias1", "rms_norm,weight1 only"])
def test_weight1_values_and_every_gradient(case, N, dtype, backend):
    """flash-attn's parallel-residual form: y and y1 = norm(h) * weight1 (+ bias1) from one set of
    statistics, h = x + x1 + residual in fp32 returned (LayerNorm, prenorm) or h = x (RMSNorm, weights
    in x's dtype, no bias1): values and the gradients of every input against float64."""
    is_rms = case.startswith("rms")
    shape = (2, 3, N)
    w_dtype = dtype if is_rms else "float32"
    inputs = dict(x=randn(shape, dtype, requires_grad=True), weight=randn((N,), w_dtype, requires_grad=True),
                  bias=None if is_rms else randn((N,), w_dtype, requires_grad=True),
                  residual=None if is_rms else randn(shape, dtype, requires_grad=True),
                  x1=None if is_rms else randn(shape, dtype, requires_grad=True),
                  weight1=randn((N,), w_dtype, requires_grad=True),
                  bias1=None if is_rms else randn((N,), w_dtype, requires_grad=True))
    fn = rms_norm_fn if is_rms else layer_norm_fn
    outs = fn(inputs["x"], inputs["weight"], inputs["bias"], inputs["residual"], inputs["x1"], inputs["weight1"],
              inputs["bias1"], eps=1e-5, prenorm=not is_rms, residual_in_fp32=not is_rms, backend=backend)
    ys, h = list(outs[:2]), (inputs["x"] if is_rms else outs[2])
    assert all(y.dtype == inputs["x"].dtype and list(y.shape) == list(shape) for y in ys)
    cots = [randn(shape, dtype) for _ in ys] + ([] if is_rms else [randn(shape, "float32")])
    names = [name for name, t in inputs.items() if t is not None]
    grads = paddle.grad(ys + ([] if is_rms else [h]), [inputs[n] for n in names], cots)

    leaves, ys64, h64 = _norm64(inputs, h, is_rms)
    refs = paddle.grad(ys64 + ([] if is_rms else [h64]), [leaves[n] for n in names],
                       [paddle.to_tensor(to64(c)) for c in cots])
    for i, (y, y64) in enumerate(zip(ys, ys64)):
        assert_close(f"weight1 y{i}", to64(y), y64.numpy(), dtype)
    if not is_rms:
        assert_close("weight1 h", to64(h), h64.numpy(), dtype)
    _check_grads64("weight1", names, grads, refs, dtype, h64, [to64(c) for c in cots[:2]],
                   [to64(inputs["weight"]), to64(inputs["weight1"])], is_rms, None if is_rms else to64(cots[2]))


def _np_norm_weight1(h, w, b, w1, b1, dy, dy1, eps, is_rms):
    """float64 y, y1, dx and the four weights' gradients of a norm with a second output (numpy)."""
    centred = h if is_rms else h - h.mean(-1, keepdims=True)
    rstd = 1.0 / np.sqrt((centred * centred).mean(-1, keepdims=True) + eps)
    xhat = centred * rstd
    wdy = dy * w + dy1 * w1
    dx = wdy - xhat * (xhat * wdy).mean(-1, keepdims=True) - (0.0 if is_rms else wdy.mean(-1, keepdims=True))
    return dict(y=xhat * w + (0.0 if b is None else b), y1=xhat * w1 + (0.0 if b1 is None else b1), dx=dx * rstd,
                dweight=(dy * xhat).sum(0), dbias=dy.sum(0), dweight1=(dy1 * xhat).sum(0), dbias1=dy1.sum(0))


@pytest.mark.parametrize("is_rms_norm", [False, True], ids=["layer_norm", "rms_norm"])
@pytest.mark.parametrize("max_block", [8, triton_norm.FWD_MAX_BLOCK], ids=["chunks and slabs", "one block"])
def test_weight1_launcher_paths_poisoned(max_block, is_rms_norm):
    """weight1 at the launchers, every output poisoned with NaN: one register block, or (max_block=8
    for 37 columns) the chunked forward and the column-slab backward with its row-statistics
    pre-pass; y1 and dy1 rows at a stride (column slices of wider buffers); the sums kernel writes
    dweight, [dbias,] dweight1, [dbias1] from their partial rows (LayerNorm with bias and bias1,
    RMSNorm with neither)."""
    M, N = 7, 37
    nan = lambda *shape: paddle.full(list(shape), float("nan"), dtype="float32")  # noqa: E731
    x, dy = randn((M, N)), randn((M, N))
    dy1 = randn((M, N + 5))[:, 2:N + 2]
    w, w1 = randn((N,)), randn((N,))
    b, b1 = (None, None) if is_rms_norm else (randn((N,)), randn((N,)))
    y, y1_buffer, mean, rstd = nan(M, N), nan(M, N + 5), nan(M), nan(M)
    y1 = y1_buffer[:, 3:N + 3]
    triton_norm.norm_fwd(*triton_args(x, w, b, y, None if is_rms_norm else mean, rstd), **dict(zip(
        ("weight1", "bias1", "y1"), triton_args(w1, b1, y1))), eps=1e-5, is_rms_norm=is_rms_norm, max_block=max_block)
    dx, dw, dw1 = nan(M, N), nan(N), nan(N)
    db, db1 = (None, None) if is_rms_norm else (nan(N), nan(N))
    partials, rowstats = triton_norm.bwd_workspace_shapes(M, N, not is_rms_norm, max_block=max_block,
                                                          has_weight1=True, has_bias1=not is_rms_norm)
    assert partials[0] == (2 if is_rms_norm else 4) and (rowstats is None) == (max_block > N)
    triton_norm.norm_bwd(*triton_args(x, w, None if is_rms_norm else mean, rstd, dy, dx, dw, nan(*partials)),
                         **dict(zip(("dbias", "rowstats", "weight1", "dy1", "dweight1", "dbias1"), triton_args(
                             db, None if rowstats is None else nan(*rowstats), w1, dy1, dw1, db1))),
                         is_rms_norm=is_rms_norm, max_block=max_block)
    want = _np_norm_weight1(to64(x), to64(w), None if b is None else to64(b), to64(w1), None if b1 is None else to64(b1),
                            to64(dy), to64(dy1), 1e-5, is_rms_norm)
    got = dict(y=y, y1=y1, dx=dx, dweight=dw, dbias=db, dweight1=dw1, dbias1=db1)
    for name, t in got.items():
        if t is not None:
            assert_close(f"launcher {name}", to64(t), want[name], "float32")
    assert np.isnan(y1_buffer.numpy()[:, :3]).all() and np.isnan(y1_buffer.numpy()[:, N + 3:]).all()


def test_weight1_launcher_bad_input():
    x, w = randn((3, 8)), randn((8,))
    stats, y = paddle.zeros([3]), paddle.empty([3, 8])
    fwd = triton_args(x, w, None, y, stats, stats)
    for error, message, kwargs in [
        (ValueError, "y1: given without weight1", dict(y1=y)),
        (ValueError, "bias1: given without weight1", dict(bias1=w)),
        (ValueError, "y1: needed with weight1", dict(weight1=w)),
        (ValueError, r"bias1: expected shape \(8,\)", dict(weight1=w, y1=y, bias1=randn((4,)))),
        (ValueError, "weight1: not supported together with z", dict(weight1=w, y1=y, z=x)),
    ]:
        with pytest.raises(error, match=message):
            triton_norm.norm_fwd(*fwd, **dict(zip(kwargs, triton_args(*kwargs.values()))))
    partials = paddle.zeros([1, 2, 8])
    bwd = triton_args(x, w, stats, stats, x, paddle.empty([3, 8]), paddle.empty([8]), partials)
    for error, message, kwargs in [
        (ValueError, "dy1: needed with weight1", dict(weight1=w, dweight1=w)),
        (ValueError, "dweight1: needed with weight1", dict(weight1=w, dy1=x)),
        (ValueError, "dbias1: given without weight1", dict(dbias1=w)),
        (ValueError, r"dweight1: expected shape \(8,\)", dict(weight1=w, dy1=x, dweight1=randn((3,)))),
        (ValueError, r"partials: expected an fp32 workspace \[2, P >= 1, 8\]", dict(weight1=w, dy1=x, dweight1=w)),
    ]:
        with pytest.raises(error, match=message):
            triton_norm.norm_bwd(*bwd, **dict(zip(kwargs, triton_args(*kwargs.values()))))


def test_weight1_routing(monkeypatch):
    """weight1 runs on Triton (explicit, or auto where the CUDA kernels come first: auto skips them,
    saying why) and the reference; an explicit CUDA backend refuses it naming weight1."""
    monkeypatch.setattr(runtime_backend, "_warned", set())
    monkeypatch.setattr(runtime_backend, "backend_status", lambda name, device: runtime_backend.BackendStatus(True, ""))
    x, w, w1 = randn((3, 8)), randn((8,)), randn((8,))
    with pytest.raises(runtime_backend.BackendUnavailableError, match="weight1: not in the CUDA kernels"):
        rms_norm_fn(x, w, None, weight1=w1, backend="cuda")
    triton = rms_norm_fn(x, w, None, weight1=w1, backend="triton")
    monkeypatch.setattr("paddlenlp_fused.ops.norm.device_of", lambda t: "gpu")  # auto's GPU order: CUDA first at N=8
    with pytest.warns(RuntimeWarning, match=r"falling back to the triton backend \(cuda: weight1: not in the CUDA"):
        auto = rms_norm_fn(x, w, None, weight1=w1, backend="auto")
    np.testing.assert_array_equal(np.stack([t.numpy() for t in auto]), np.stack([t.numpy() for t in triton]))


_BUFFER_CASES = {  # which preallocated outputs, with which options
    "out,residual_out,residual,prenorm": dict(out=True, residual_out=True, residual=True, prenorm=True),
    "residual_out without prenorm": dict(residual_out=True, residual=True),
    "out,residual_out, h is x": dict(out=True, residual_out=True, prenorm=True),
    "strided out,weight1,residual_out fp32": dict(out="strided", residual_out=True, residual=True, prenorm=True,
                                                  residual_in_fp32=True, weight1=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("case", list(_BUFFER_CASES))
def test_out_and_residual_out_written_in_place_and_returned(case, dtype, backend):
    """flash-attn's ``out`` / ``residual_out`` (poisoned with NaN): written in place (a strided out
    only where it views its buffer), returned as the very objects, equal to what the call returns
    without them; residual_out holds h also without prenorm, and x itself where h is x. A loss on
    the returned tensors gives every input its gradient (against float64)."""
    opts = _BUFFER_CASES[case]
    shape, N = (3, 4, 37), 37
    h_dtype = "float32" if opts.get("residual_in_fp32") else dtype
    inputs = dict(x=randn(shape, dtype, requires_grad=True), weight=randn((N,), "float32", requires_grad=True),
                  bias=randn((N,), "float32", requires_grad=True),
                  residual=randn(shape, dtype, requires_grad=True) if opts.get("residual") else None,
                  weight1=randn((N,), "float32", requires_grad=True) if opts.get("weight1") else None)
    kwargs = dict(prenorm=opts.get("prenorm", False), residual_in_fp32=opts.get("residual_in_fp32", False),
                  backend=backend)

    def call(**more):
        return layer_norm_fn(inputs["x"], inputs["weight"], inputs["bias"], inputs["residual"],
                             weight1=inputs["weight1"], **{**kwargs, **more})

    plain = call()
    plain = list(plain) if isinstance(plain, tuple) else [plain]
    nan = lambda shape, dtype: paddle.full(list(shape), float("nan"), dtype=dtype)  # noqa: E731
    out_buffer = nan((3, 4, N + 6), dtype) if opts.get("out") == "strided" else None
    out = out_buffer[..., 2:N + 2] if out_buffer is not None else (nan(shape, dtype) if opts.get("out") else None)
    residual_out = nan(shape, h_dtype) if opts.get("residual_out") else None
    got = call(out=out, residual_out=residual_out)
    got = list(got) if isinstance(got, tuple) else [got]
    assert len(got) == len(plain)
    if out is not None:
        assert got[0] is out
    if out_buffer is not None:
        assert np.isnan(to64(out_buffer)[..., :2]).all() and np.isnan(to64(out_buffer)[..., N + 2:]).all()
    h = call(prenorm=True)[-1]  # the stream, as returned with prenorm
    if residual_out is not None:
        assert got[-1] is residual_out if kwargs["prenorm"] else all(g is not residual_out for g in got)
        np.testing.assert_array_equal(to64(residual_out), to64(h))
    for i, (g, p) in enumerate(zip(got, plain)):
        assert g.dtype == p.dtype
        np.testing.assert_array_equal(to64(g), to64(p), err_msg=f"output {i}")

    cots = [randn(shape, str(g.dtype).split(".")[-1]) for g in got]
    names = [name for name, t in inputs.items() if t is not None]
    grads = paddle.grad(got, [inputs[n] for n in names], cots)
    leaves, ys64, h64 = _norm64(inputs, h, False)
    refs = paddle.grad(ys64 + ([h64] if kwargs["prenorm"] else []), [leaves[n] for n in names],
                       [paddle.to_tensor(to64(c)) for c in cots])
    weights = [to64(inputs["weight"])] + ([] if inputs["weight1"] is None else [to64(inputs["weight1"])])
    _check_grads64(f"buffers {case}", names, grads, refs, dtype, h64, [to64(c) for c in cots[:len(ys64)]], weights,
                   False)


@pytest.mark.parametrize("backend", BACKENDS)
def test_out_sets_y_dtype_as_in_flash_attn(backend):
    """y is written in out's dtype (flash-attn's rule) unless out_dtype says otherwise, which out
    must then match."""
    x, w = randn((4, 24), "bfloat16"), randn((24,))
    out = paddle.full([4, 24], float("nan"), dtype="float32")
    y = rms_norm_fn(x, w, out=out, backend=backend)
    assert y is out
    np.testing.assert_array_equal(out.numpy(), rms_norm_fn(x, w, out_dtype="float32", backend=backend).numpy())


@pytest.mark.parametrize("backend", BACKENDS + ["cuda"])
def test_out_and_residual_out_bad_input(backend):
    """Checked before any backend runs: the same errors, naming the argument, on every backend."""
    x, w, res = randn((3, 8)), randn((8,)), randn((3, 8))
    leaf = randn((3, 8), requires_grad=True)
    cases = [
        (TypeError, "out: expected a paddle.Tensor", dict(out=np.zeros((3, 8), np.float32))),
        (TypeError, "out: expected dtype in", dict(out=paddle.zeros([3, 8], dtype="int32"))),
        (ValueError, r"out: expected x's shape \[3, 8\], got \[3, 4\]", dict(out=randn((3, 4)))),
        (TypeError, "out: expected out_dtype bfloat16, got float32", dict(out=randn((3, 8)), out_dtype="bfloat16")),
        (ValueError, "out: a leaf that requires a gradient", dict(out=leaf)),
        (ValueError, "out: shares memory with x", dict(out=x)),
        (ValueError, "out: shares memory with residual", dict(out=res, residual=res)),
        (ValueError, r"residual_out: expected x's shape \[3, 8\]", dict(residual_out=randn((8,)))),
        (TypeError, "residual_out: expected the residual stream's dtype float32", dict(
            residual_out=randn((3, 8), "bfloat16"), residual_in_fp32=True)),
        (TypeError, "residual_out: expected the residual stream's dtype bfloat16", dict(
            residual_out=randn((3, 8)), residual=randn((3, 8), "bfloat16"))),
        (ValueError, "residual_out: shares memory with residual", dict(residual_out=res, residual=res)),
        (ValueError, "residual_out: shares memory with out", dict(residual_out=res, out=res)),
    ]
    for error, message, kwargs in cases:
        with pytest.raises(error, match=message):
            layer_norm_fn(x, w, None, backend=backend, **kwargs)
