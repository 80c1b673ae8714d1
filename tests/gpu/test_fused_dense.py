"""Fused dense GEMMs on the GPU: the cuBLASLt epilogues (csrc/fused_dense.cu) and the Triton GEMM's,
against float64 references (fp32-upcast inputs), outputs poisoned with NaN, odd shapes and strides."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.cuda import fused_dense as lt
from paddlenlp_fused.kernels.triton import fused_dense as tr
from paddlenlp_fused.testing.numerics import UNIT_ROUNDOFF, assert_close, bound_for

DTYPES = ("bfloat16", "float16", "float32")
# (M, K, N): each axis of size 1 somewhere, odd and aligned widths. No single-element output: its
# normwise error is one element's, which cancellation (x @ w ~ -bias) makes ill-conditioned.
SHAPES = [(1, 1, 48), (37, 96, 1), (7, 33, 65), (333, 1537, 129), (64, 200, 8)]
_C = np.sqrt(2 / np.pi)
# cuBLASLt's GELU epilogues evaluate tanh approximately: per-element relative error up to ~3.5e-5
# (seen on the H200), over fp32's 1e-5 bound and far under 16-bit rounding. The ops therefore use
# them for 16-bit dtypes only; for float32 outputs they are checked against this measured bound.
LT_GELU_FP32_BOUND = 1e-4


def _gelu(p):
    return 0.5 * p * (1 + np.tanh(_C * (p + 0.044715 * p**3)))


def _dgelu(p):
    t = np.tanh(_C * (p + 0.044715 * p**3))
    return 0.5 * (1 + t) + 0.5 * p * (1 - t * t) * _C * (1 + 3 * 0.044715 * p * p)


ACT64 = {"none": (lambda p: p, None), "gelu_approx": (_gelu, _dgelu),
         "relu": (lambda p: np.maximum(p, 0), lambda p: (p > 0).astype(np.float64))}


@pytest.fixture(scope="module")
def ws(provider):
    ok, why = lt.status()
    if not ok:
        pytest.fail(f"the CUDA fused dense kernels must run on this GPU machine: {why}")
    return provider.empty((lt.workspace_bytes(0),), "uint8")


def _inputs(provider, M, K, N, dtype):
    return (provider.randn((M, K), dtype), provider.randn((K, N), dtype, scale=K**-0.5),
            provider.randn((N,), dtype))


def _round(a, dtype):
    """float64 values rounded to ``dtype`` (nearest even), as a framework's kernel stores them."""
    if dtype == "float32":
        return a.astype(np.float32).astype(np.float64)
    if dtype == "float16":
        return a.astype(np.float16).astype(np.float64)
    bits = a.astype(np.float32).view(np.uint32)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.astype(np.uint32).view(np.float32).astype(np.float64)


def _plain_rel(a, ref, scale=None):
    """Relative error of ``a``; against the norm of ``scale`` when given (the magnitudes of a sum's
    terms, for outputs where the sum may cancel)."""
    return float(np.linalg.norm(a - ref) / max(np.linalg.norm(ref if scale is None else scale), 1e-300))


def _plain_baseline(pre, act, bias, dtype, ref, scale=None):
    """Error of the plain composition in ``dtype`` (matmul rounded, bias added and rounded,
    activation rounded): the bound's baseline for an output with a bias."""
    if dtype == "float32":
        return None
    h = _round(_round(pre - bias, dtype) + bias, dtype)
    return _plain_rel(_round(act(h), dtype), ref, scale)


def _bias_terms(pre, bias):
    """|x w| + |b|: with a bias the output is a two-term sum, which cancels where x w ~ -b (then even the
    plain composition in bf16 misses DESIGN's 1e-2 cap, e.g. 1.5e-2 on 37 rows x 1 column); its error
    is measured against the terms' magnitudes, as DESIGN says for sums."""
    return np.abs(pre - bias) + np.abs(bias)


def _check(name, out, ref, dtype, baseline=None, gelu=False, scale=None):
    if gelu and dtype == "float32":
        err = _plain_rel(out, ref, scale)
        assert err <= LT_GELU_FP32_BOUND, f"{name} (float32, cuBLASLt GELU): relative error {err:.3e}"
        return
    if scale is None:
        assert_close(name, out, ref, dtype, baseline_err=baseline)
        return
    err, bound = _plain_rel(out, ref, scale), bound_for(dtype, baseline)
    assert err <= bound, f"{name} ({dtype}): error / |terms| {err:.3e} exceeds bound {bound:.3e}"


def _aux(provider, activation, M, N, dtype):
    shape, aux_dtype = lt.aux_shape(activation, M, N)
    return provider.poisoned(shape, dtype) if aux_dtype is None else provider.zeros(shape, aux_dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation,with_bias,with_aux", [
    ("none", False, False), ("none", True, False), ("gelu_approx", True, True), ("gelu_approx", False, False),
    ("gelu_approx", True, False), ("relu", True, True), ("relu", False, True)])
def test_cuda_forward_epilogues(provider, ws, shape, dtype, activation, with_bias, with_aux):
    M, K, N = shape
    x, w, b = _inputs(provider, M, K, N, dtype)
    out = provider.poisoned((M, N), dtype)
    aux = _aux(provider, activation, M, N, dtype) if with_aux else None
    lt.linear_act_fwd(x, w, out, ws, bias=b if with_bias else None, activation=activation, aux=aux)
    provider.synchronize()
    bias = provider.to_numpy(b) if with_bias else 0.0
    pre = provider.to_numpy(x) @ provider.to_numpy(w) + bias
    act = ACT64[activation][0]
    terms = _bias_terms(pre, bias) if with_bias else None
    baseline = _plain_baseline(pre, act, bias, dtype, act(pre), terms) if with_bias else None
    _check("out", provider.to_numpy(out), act(pre), dtype, baseline, gelu=activation == "gelu_approx", scale=terms)
    if with_aux and activation == "gelu_approx":
        _check("aux (pre-activation)", provider.to_numpy(aux)[:, :N], pre, dtype,
               _plain_baseline(pre, lambda h: h, bias, dtype, pre, terms), scale=terms)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_cuda_input_gradient_gemm_with_transposed_weight(provider, ws, shape, dtype):
    """dx[M,K] = dy[M,N] @ w[K,N]^T, dy with a row stride past its width (a column slice)."""
    M, K, N = shape
    wide = provider.randn((M, N + 24), dtype)
    dy = wide[:, 8:8 + N]
    w = provider.randn((K, N), dtype, scale=N**-0.5)
    dx = provider.poisoned((M, K), dtype)
    lt.linear_act_fwd(dy, w, dx, ws, weight_transposed=True)
    provider.synchronize()
    assert_close("dx", provider.to_numpy(dx), provider.to_numpy(dy) @ provider.to_numpy(w).T, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("with_dbias", [True, False])
def test_cuda_weight_gradient_with_bias_gradient(provider, ws, shape, dtype, with_dbias):
    M, K, N = shape
    x, dy = provider.randn((M, K), dtype), provider.randn((M, N), dtype)
    dw = provider.poisoned((K, N), dtype)
    db = provider.poisoned((N,), dtype) if with_dbias else None
    lt.linear_wgrad(x, dy, dw, ws, dbias=db)
    provider.synchronize()
    assert_close("dweight", provider.to_numpy(dw), provider.to_numpy(x).T @ provider.to_numpy(dy), dtype)
    if with_dbias:
        assert_close("dbias", provider.to_numpy(db), provider.to_numpy(dy).sum(0), dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("activation", ["gelu_approx", "relu"])
@pytest.mark.parametrize("with_dbias", [True, False])
def test_cuda_activation_backward_epilogue(provider, ws, shape, dtype, activation, with_dbias):
    """GEMM1 saves the pre-activation (GELU values / ReLU bits); the backward GEMM reads it:
    dpre[M,H] = act'(pre) * (dout[M,N] @ w2[H,N]^T), dbias1 = dpre.sum(0)."""
    M, D, H = shape  # x [M, D] -> pre [M, H]; w2 [H, N] with N = D
    x, w1, b1 = _inputs(provider, M, D, H, dtype)
    out1 = provider.poisoned((M, H), dtype)
    aux = _aux(provider, activation, M, H, dtype)
    lt.linear_act_fwd(x, w1, out1, ws, bias=b1, activation=activation, aux=aux)
    dout, w2 = provider.randn((M, D), dtype), provider.randn((H, D), dtype, scale=D**-0.5)
    dpre = provider.poisoned((M, H), dtype)
    db = provider.poisoned((H,), dtype) if with_dbias else None
    lt.linear_act_bwd(dout, w2, aux, dpre, ws, dbias=db, activation=activation)
    provider.synchronize()
    got = provider.to_numpy(dpre)
    if activation == "gelu_approx":  # gelu' at the pre-activation the kernel saved (read back)
        ref = (provider.to_numpy(dout) @ provider.to_numpy(w2).T) * _dgelu(provider.to_numpy(aux)[:, :H])
    else:
        # ReLU's derivative jumps at 0: where the exact pre-activation is within 16-bit rounding of
        # zero, the kernel's mask may take either side (seen on the H200: the 16-bit RELU_AUX mask
        # disagrees with the sign of its own output there), so those elements are left out.
        exact = provider.to_numpy(x) @ provider.to_numpy(w1) + provider.to_numpy(b1)
        scale = np.abs(provider.to_numpy(x)) @ np.abs(provider.to_numpy(w1)) + np.abs(provider.to_numpy(b1))
        kink = np.abs(exact) <= (0.0 if dtype == "float32" else 4 * UNIT_ROUNDOFF[dtype]) * scale
        ref = (provider.to_numpy(dout) @ provider.to_numpy(w2).T) * (exact > 0)
        got, ref = np.where(kink, 0.0, got), np.where(kink, 0.0, ref)
        with_dbias = with_dbias and not kink.any()  # the bias gradient sums over the kinks too
    gelu = activation == "gelu_approx"
    _check("dpre", got, ref, dtype, gelu=gelu)
    if with_dbias:
        # a column sum over the rows, which may cancel (one column of 37 rows drew 10x its norm): measured
        # against the sum of its terms' magnitudes
        terms = np.abs(ref).sum(0)
        dpre_rounded = _round(ref, dtype)  # the plain composition sums the rounded dpre
        baseline = _plain_rel(_round(dpre_rounded.sum(0), dtype), ref.sum(0), terms) if dtype != "float32" else None
        _check("dbias1", provider.to_numpy(db), ref.sum(0), dtype, baseline, gelu=gelu, scale=terms)


@pytest.mark.parametrize("heuristic", range(8))
def test_cuda_every_heuristic_index_is_correct(provider, ws, heuristic):
    M, K, N = 1000, 1024, 768
    x, w, b = _inputs(provider, M, K, N, "bfloat16")
    out = provider.poisoned((M, N), "bfloat16")
    aux = _aux(provider, "gelu_approx", M, N, "bfloat16")
    lt.linear_act_fwd(x, w, out, ws, bias=b, activation="gelu_approx", aux=aux, heuristic=heuristic)
    provider.synchronize()
    pre = provider.to_numpy(x) @ provider.to_numpy(w) + provider.to_numpy(b)
    assert_close(f"out (heuristic {heuristic})", provider.to_numpy(out), _gelu(pre), "bfloat16")


def test_cuda_bad_input_raises(provider, ws):
    x, w, b = _inputs(provider, 8, 16, 24, "bfloat16")
    out = provider.empty((8, 24), "bfloat16")
    with pytest.raises(ValueError, match="weight: expected shape"):
        lt.linear_act_fwd(x, provider.empty((15, 24), "bfloat16"), out, ws)
    with pytest.raises(TypeError, match="weight: expected dtype bfloat16"):
        lt.linear_act_fwd(x, provider.empty((16, 24), "float16"), out, ws)
    with pytest.raises(ValueError, match="aux: expected shape"):
        lt.linear_act_fwd(x, w, out, ws, activation="relu", aux=provider.zeros((8, 24), "uint8"))
    with pytest.raises(ValueError, match="activation"):
        lt.linear_act_fwd(x, w, out, ws, activation="tanh")
    with pytest.raises(ValueError, match="last axis must be contiguous"):
        lt.linear_act_fwd(provider.randn((16, 8), "bfloat16").t(), w, out, ws)


@pytest.mark.parametrize("config", range(len(tr._TUNED_CONFIGS)))
def test_triton_every_tuned_config_with_long_reductions(provider, config):
    """Each autotune config, forced, on the MLP's backward GEMMs with a long reduction (K = 16384
    tokens in the weight gradient, as in the benchmark), and the activation-gradient GEMM."""
    import triton

    cfg = tr._TUNED_CONFIGS[config]
    meta = dict(cfg.kwargs, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    T, D, H, dtype = 16384, 512, 384, "bfloat16"
    x, dpre = provider.randn((T, D), dtype), provider.randn((T, H), dtype)
    dw = provider.poisoned((D, H), dtype)
    flags = dict(HAS_BIAS=False, ACTIVATION=0, SAVE_PRE=False, ACT_GRAD=False, FP32_DOT=False)
    grid = (triton.cdiv(D, meta["BLOCK_M"]) * triton.cdiv(H, meta["BLOCK_N"]),)
    tr._gemm_kernel[grid](x, dpre, dw, dw, dw, D, H, T, 1, D, H, 1, H, 0, **flags, **meta)
    M = 2048
    dout, w2, pre = provider.randn((M, D), dtype), provider.randn((H, D), dtype, scale=D**-0.5), \
        provider.randn((M, H), dtype)
    dp = provider.poisoned((M, H), dtype)
    grid = (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(H, meta["BLOCK_N"]),)
    tr._gemm_kernel[grid](dout, w2, dp, dp, pre, M, H, D, D, 1, 1, D, H, H,
                          **dict(flags, ACTIVATION=1, ACT_GRAD=True), **meta)
    provider.synchronize()
    assert_close(f"dweight (config {config})", provider.to_numpy(dw),
                 provider.to_numpy(x).T @ provider.to_numpy(dpre), dtype)
    ref = (provider.to_numpy(dout) @ provider.to_numpy(w2).T) * _dgelu(provider.to_numpy(pre))
    assert_close(f"act grad (config {config})", provider.to_numpy(dp), ref, dtype)


def test_triton_column_sum_over_a_long_axis(provider):
    """The weight-gradient GEMM's bias gradient: column sums over 16384 tokens, bf16 in, fp32 and bf16 out."""
    T, H = 16384, 1000
    dy = provider.randn((T, H), "bfloat16")
    for dtype in ("float32", "bfloat16"):
        db = provider.poisoned((H,), dtype)
        tr._column_sum(dy, db, T, H, H, 1)
        provider.synchronize()
        assert_close(f"column sums ({dtype})", provider.to_numpy(db), provider.to_numpy(dy).sum(0), dtype)


def _triton_case(provider, M, K, N, dtype, activation):
    x, w, b = _inputs(provider, M, K, N, dtype)
    out, pre = provider.poisoned((M, N), dtype), provider.poisoned((M, N), dtype)
    tr.gemm(x, w, out, bias=b, activation=activation, pre=pre if activation != "none" else None)
    return x, w, b, out, pre


TRITON_ACT64 = dict(ACT64, gelu=None, sqrelu=(lambda p: np.maximum(p, 0) ** 2, lambda p: 2 * np.maximum(p, 0)))


def _erf_gelu(p):
    from math import erf

    cdf = 0.5 * (1 + np.vectorize(erf)(p / np.sqrt(2)))
    return p * cdf, cdf + p * np.exp(-0.5 * p * p) / np.sqrt(2 * np.pi)


# Few shapes per dtype: each new stride class (1, multiple of 16, other) compiles every autotune
# config again; size 1 is covered by the interpreter suite.
TRITON_CASES = [("bfloat16", (7, 33, 65)), ("bfloat16", (1024, 2048, 1536)), ("float16", (333, 1537, 129)),
                ("float32", (333, 1537, 129))]


@pytest.mark.parametrize("dtype,shape", TRITON_CASES, ids=str)
def test_triton_gemm_epilogues(provider, shape, dtype):
    """Forward with bias + gelu_approx + saved pre-activation; the activation-gradient GEMM; the
    weight-gradient GEMM with its bias gradient; the input-gradient GEMM (transposed operand)."""
    M, K, N = shape
    x, w, b, out, pre = _triton_case(provider, M, K, N, dtype, "gelu_approx")
    dout, w2 = provider.randn((M, K), dtype), provider.randn((N, K), dtype, scale=K**-0.5)
    dpre = provider.poisoned((M, N), dtype)
    tr.gemm(dout, w2, dpre, activation="gelu_approx", pre=pre, act_grad=True, trans_b=True)
    dw, db = provider.poisoned((K, N), dtype), provider.poisoned((N,), "float32")
    tr.gemm(x, dpre, dw, dbias=db, trans_a=True)
    dx = provider.poisoned((M, K), dtype)
    tr.gemm(dpre, w, dx, trans_b=True)
    provider.synchronize()
    X, W, B = (provider.to_numpy(t) for t in (x, w, b))
    ref_pre = X @ W + B
    assert_close("pre", provider.to_numpy(pre), ref_pre, dtype)
    saved = provider.to_numpy(pre)
    assert_close("out", provider.to_numpy(out), _gelu(saved), dtype)
    ref_dpre = (provider.to_numpy(dout) @ provider.to_numpy(w2).T) * _dgelu(saved)
    assert_close("dpre", provider.to_numpy(dpre), ref_dpre, dtype)
    DPRE = provider.to_numpy(dpre)
    assert_close("dweight", provider.to_numpy(dw), X.T @ DPRE, dtype)
    assert_close("dbias", provider.to_numpy(db), DPRE.sum(0), "float32" if dtype == "float32" else dtype)
    assert_close("dx", provider.to_numpy(dx), DPRE @ W.T, dtype)


@pytest.mark.parametrize("activation", ["gelu_approx", "gelu", "relu", "sqrelu"])
def test_triton_activation_epilogues_and_elementwise_kernels(provider, activation):
    """Every activation: the epilogue output equals the elementwise kernel on the saved
    pre-activation bit for bit (what checkpoint level 1 relies on); both against float64."""
    M, K, N, dtype = 333, 257, 129, "bfloat16"
    x, w, b, out, pre = _triton_case(provider, M, K, N, dtype, activation)
    again = provider.poisoned((M, N), dtype)
    tr.act_fwd(pre, again, activation)
    dout, dpre = provider.randn((M, N), dtype), provider.poisoned((M, N), dtype)
    tr.act_bwd(pre, dout, dpre, activation)
    provider.synchronize()
    np.testing.assert_array_equal(provider.to_numpy(again), provider.to_numpy(out))
    saved = provider.to_numpy(pre)
    act, grad = _erf_gelu(saved) if activation == "gelu" else \
        (TRITON_ACT64[activation][0](saved), TRITON_ACT64[activation][1](saved))
    assert_close("act", provider.to_numpy(out), act, dtype)
    assert_close("act grad", provider.to_numpy(dpre), provider.to_numpy(dout) * grad, dtype)


def test_small_case_for_sanitizer(provider, ws):
    """Every entry point once on small odd shapes (the case compute-sanitizer runs)."""
    M, K, N = 37, 45, 70
    for activation in ("gelu_approx", "relu"):
        x, w, b = _inputs(provider, M, K, N, "bfloat16")
        out, aux = provider.poisoned((M, N), "bfloat16"), _aux(provider, activation, M, N, "bfloat16")
        lt.linear_act_fwd(x, w, out, ws, bias=b, activation=activation, aux=aux)
        dout, w2 = provider.randn((M, K), "bfloat16"), provider.randn((N, K), "bfloat16")
        dpre, db = provider.poisoned((M, N), "bfloat16"), provider.poisoned((N,), "bfloat16")
        lt.linear_act_bwd(dout, w2, aux, dpre, ws, dbias=db, activation=activation)
        dw = provider.poisoned((K, N), "bfloat16")
        lt.linear_wgrad(x, dpre, dw, ws, dbias=db)
        lt.linear_act_fwd(dpre, w, provider.poisoned((M, K), "bfloat16"), ws, weight_transposed=True)
    provider.synchronize()
    assert np.all(np.isfinite(provider.to_numpy(dw)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (37, 1000), (16384, 520), (3000, 16384)], ids=str)
def test_triton_activation_backward_with_bias_gradient(provider, shape, dtype):
    """act_bwd_dbias (the CUDA backend's backward between its plain GEMMs): dpre = dout * gelu'(pre)
    and its column sums (row splits summed in order), outputs poisoned; pre at a row stride past its
    width. column_sum alone on the same dout."""
    M, N = shape
    pre = provider.randn((M, N + 8), dtype)[:, 4:4 + N]
    dout = provider.randn((M, N), dtype)
    dpre, dbias = provider.poisoned((M, N), dtype), provider.poisoned((N,), dtype)
    partial = provider.poisoned(tr.colsum_partial_shape(M, N), "float32")
    tr.act_bwd_dbias(pre, dout, dpre, dbias, partial, "gelu_approx")
    colsum = provider.poisoned((N,), "float32")
    tr.column_sum(dout, colsum, provider.poisoned(tr.colsum_partial_shape(M, N), "float32"))
    provider.synchronize()
    ref = provider.to_numpy(dout) * _dgelu(provider.to_numpy(pre))
    assert_close("dpre", provider.to_numpy(dpre), ref, dtype)
    stored = provider.to_numpy(dpre)  # the sums are of the stored (rounded) dpre, in fp32
    terms = np.abs(stored).sum(0)
    err = np.max(np.abs(provider.to_numpy(dbias) - stored.sum(0)) / np.maximum(terms, 1e-300))
    assert err <= bound_for(dtype), f"dbias ({dtype}): error / |terms| {err:.3e}"
    D = provider.to_numpy(dout)
    err = np.max(np.abs(provider.to_numpy(colsum) - D.sum(0)) / np.maximum(np.abs(D).sum(0), 1e-300))
    assert err <= bound_for("float32"), f"column_sum: error / |terms| {err:.3e}"
