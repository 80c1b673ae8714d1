"""Multi-tensor AdamW kernel on the GPU against float64: every storage combination, odd sizes
(1, non-multiples of the block), hundreds of tensors in one launch, unaligned addresses, bytes
between tensors untouched, a tensor past 2^31 elements, stochastic rounding unbiased."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton.adamw import (BLOCK, ITERS, adamw_multi_tensor, hyper_rows, offsets_table,
                                                  plan_chunks, step_seed)
from paddlenlp_fused.testing.numerics import assert_close, rel_err

CHUNK = BLOCK * ITERS  # elements per program
SIZES = [1, 7, BLOCK - 1, BLOCK, BLOCK + 1, CHUNK - 1, CHUNK, CHUNK + BLOCK + 3, 3 * CHUNK + 5, 65536 + 13, 1_000_003]
MANTISSA_BITS = {"bfloat16": 7, "float16": 10}
# The weight moves by ~lr = 1e-2 of its size; its fp32 rounding (2^-24 |w|) is ~6e-6 of the move.
UPDATE_BOUND = 1e-4
N_SR = 1 << 22  # values per stochastic-rounding check: 5 standard errors = 0.1% of a spacing


def _carve(provider, sizes, dtype, values, gap):
    """Tensors holding ``values`` (numpy arrays) cut from one NaN-filled buffer, ``gap`` elements
    apart (and before the first): (buffer, views, mask of the gap elements)."""
    starts, pos = [], gap
    for n in sizes:
        starts.append(pos)
        pos += n + gap
    buffer = provider.poisoned((pos,), dtype)
    views = []
    for start, n, value in zip(starts, sizes, values):
        view = buffer[start:start + n]
        provider.copy_(view, provider.from_numpy(value, dtype))
        views.append(view)
    in_gap = np.ones(pos, dtype=bool)
    for start, n in zip(starts, sizes):
        in_gap[start:start + n] = False
    return buffer, views, in_gap


def _launch(provider, tensors, hyper, seed=step_seed(11, 1), stochastic_rounding=False):
    params, grads, exp_avgs, exp_avg_sqs, masters = tensors
    chunk_tensor, first_chunk = plan_chunks([int(np.prod(p.shape)) for p in params])
    offsets = offsets_table(params, grads, exp_avgs, exp_avg_sqs, masters, first_chunk)
    adamw_multi_tensor(params, grads, exp_avgs, exp_avg_sqs, masters, provider.from_numpy(chunk_tensor, "int32"),
                       provider.from_numpy(offsets, "int64"), provider.from_numpy(hyper, "float32"), seed=seed,
                       stochastic_rounding=stochastic_rounding)
    provider.synchronize()


def _random_hyper(n, rng):
    """Per-tensor hyper-parameters of a mid-training step t."""
    t = rng.integers(1, 200, n)
    lr, wd = rng.uniform(5e-3, 2e-2, n), rng.choice([0.0, 0.1], n)
    b1, b2, eps = rng.choice([0.9, 0.8], n), rng.choice([0.999, 0.95], n), np.full(n, 1e-8)
    b1p, b2p = np.float32(b1) ** t, np.float32(b2) ** t
    exact = tuple(np.float32(a).astype(np.float64) for a in (lr, wd, b1, b2, eps, b1p, b2p))
    return hyper_rows(lr, wd, b1, b2, eps, b1p, b2p), exact


def _adamw64(w, g, m, v, lr, wd, b1, b2, eps, b1p, b2p):
    w = w * (1 - lr * wd)
    m = b1 * m + (1 - b1) * g
    v = b2 * v + (1 - b2) * g * g
    return w - lr / (1 - b1p) * m / (np.sqrt(v) / np.sqrt(1 - b2p) + eps), m, v


def _check_step(provider, sizes, param_dtype, grad_dtype, moment_dtype, master, gap=8, seed=0):
    """One step of a group of tensors of ``sizes`` against float64, gaps between tensors untouched."""
    rng = np.random.default_rng(seed)
    normal = lambda scale: [rng.standard_normal(n) * scale for n in sizes]  # noqa: E731
    params = normal(1.0)
    values = {"param": (param_dtype, params), "grad": (grad_dtype, normal(1.0)),
              "exp_avg": (moment_dtype, normal(0.1)), "exp_avg_sq": (moment_dtype, [m * m for m in normal(0.1)])}
    if master:  # the param's value plus what its 16 bits lost
        values["master"] = ("float32", [p + rng.standard_normal(p.size) * 1e-3 for p in params])
    carved = {name: _carve(provider, sizes, dtype, vals, gap) for name, (dtype, vals) in values.items()}
    before = {name: [provider.to_numpy(t) for t in views] for name, (_, views, _) in carved.items()}
    hyper, exact = _random_hyper(len(sizes), rng)
    tensors = [carved[k][1] for k in ("param", "grad", "exp_avg", "exp_avg_sq")]
    tensors.append(carved["master"][1] if master else None)
    _launch(provider, tensors, hyper)

    weight = "master" if master else "param"
    weight_dtype = "float32" if master else param_dtype
    for i in range(len(sizes)):
        w0 = before[weight][i]
        w64, m64, v64 = _adamw64(w0, before["grad"][i], before["exp_avg"][i], before["exp_avg_sq"][i],
                                 *(h[i] for h in exact))
        w = provider.to_numpy(carved[weight][1][i])
        assert_close(f"{weight}[{i}]", w, w64, weight_dtype)
        if weight_dtype == "float32":
            err = rel_err(w - w0, w64 - w0)
            assert err <= UPDATE_BOUND, f"update of {weight}[{i}]: relative error {err:.2e}"
        if master:
            assert_close(f"param[{i}]", provider.to_numpy(carved["param"][1][i]), w64, param_dtype)
        assert_close(f"exp_avg[{i}]", provider.to_numpy(carved["exp_avg"][1][i]), m64, moment_dtype)
        assert_close(f"exp_avg_sq[{i}]", provider.to_numpy(carved["exp_avg_sq"][1][i]), v64, moment_dtype)
    for name, (buffer, _, in_gap) in carved.items():
        assert np.isnan(provider.to_numpy(buffer)[in_gap]).all(), f"{name}: the kernel wrote between tensors"


COMBOS = [  # param, grad, moments, master
    ("bfloat16", "bfloat16", "bfloat16", True), ("bfloat16", "bfloat16", "float32", True),
    ("bfloat16", "float32", "bfloat16", True), ("float16", "float16", "float16", True),
    ("float32", "float32", "bfloat16", False), ("float32", "float32", "float32", False),
    ("bfloat16", "bfloat16", "bfloat16", False), ("float16", "float16", "bfloat16", False)]


@pytest.mark.parametrize("param_dtype,grad_dtype,moment_dtype,master", COMBOS)
def test_step_matches_float64(provider, param_dtype, grad_dtype, moment_dtype, master):
    _check_step(provider, SIZES, param_dtype, grad_dtype, moment_dtype, master)


def test_many_tensors_in_one_launch(provider):
    sizes = [int(s) for s in np.random.default_rng(1).integers(1, 20000, 300)]
    _check_step(provider, sizes, "bfloat16", "bfloat16", "bfloat16", True, seed=1)


def test_unaligned_addresses(provider):
    """Tensors 1 element apart: no 16-byte alignment, the kernel takes its unhinted variant."""
    _check_step(provider, [5, CHUNK + BLOCK + 3, 77], "bfloat16", "bfloat16", "bfloat16", True, gap=1)


def test_small_case_for_sanitizer(provider):
    """Small launches of every path (run under compute-sanitizer memcheck): masters, 16-bit params
    without master, unaligned, stochastic rounding."""
    _check_step(provider, [1, 9, CHUNK + BLOCK + 5], "bfloat16", "bfloat16", "bfloat16", True, gap=1)
    _check_step(provider, [3, BLOCK], "float16", "float16", "float32", False)
    rng = np.random.default_rng(4)
    sizes = [1, 9, CHUNK + BLOCK + 5]
    tensors = [[provider.from_numpy(np.abs(rng.standard_normal(n)), "bfloat16") for n in sizes] for _ in range(4)]
    hyper = np.repeat(hyper_rows(1e-2, 0.1, 0.9, 0.999, 1e-8, 0.9, 0.999), len(sizes), axis=0)
    _launch(provider, tensors + [None], hyper, stochastic_rounding=True)
    assert all(np.isfinite(provider.to_numpy(t)).all() for ts in tensors for t in ts)


@pytest.mark.xdist_group("huge")
def test_offsets_past_2_31_elements(provider):
    """One tensor of 2^31 + 5 elements: 64-bit offsets; head and tail checked against float64."""
    n = 2**31 + 5
    tensors = [provider.randn((n,), "bfloat16"), provider.randn((n,), "bfloat16"),
               provider.randn((n,), "bfloat16", scale=0.1), provider.zeros((n,), "bfloat16"),
               provider.randn((n,), "float32")]
    ends = {"head": slice(0, 5000), "tail": slice(n - 5000, n)}
    before = {k: [provider.to_numpy(t[s]) for t in tensors] for k, s in ends.items()}
    hyper, exact = _random_hyper(1, np.random.default_rng(2))
    _launch(provider, [[t] for t in tensors], hyper)
    for k, s in ends.items():
        p0, g0, m0, v0, w0 = before[k]
        w64, m64, v64 = _adamw64(w0, g0, m0, v0, *(h[0] for h in exact))
        assert_close(f"master {k}", provider.to_numpy(tensors[4][s]), w64, "float32")
        assert_close(f"param {k}", provider.to_numpy(tensors[0][s]), w64, "bfloat16")
        assert_close(f"exp_avg {k}", provider.to_numpy(tensors[2][s]), m64, "bfloat16")
        assert_close(f"exp_avg_sq {k}", provider.to_numpy(tensors[3][s]), v64, "bfloat16")


def _spacing(x, dtype):
    """Distance between the two representable values of ``dtype`` around normal-range x."""
    return np.exp2(np.floor(np.log2(np.abs(x))) - MANTISSA_BITS[dtype])


@pytest.mark.parametrize("moment_dtype", ["bfloat16", "float16"])
def test_stochastic_rounding_of_moments_is_unbiased(provider, moment_dtype):
    """beta1 = 0 makes exp_avg = g exactly; g sits 1/4 of the way from a representable value to the
    next (nearest rounding would be biased by -1/4 spacing). The stored values are those two
    neighbours, the mean error is 0 within 5 standard errors, and the draw follows the seed."""
    n = N_SR
    rng = np.random.default_rng(3)
    lo = rng.uniform(0.02, 8.0, n) * rng.choice([-1.0, 1.0], n)
    lo = provider.to_numpy(provider.from_numpy(lo, moment_dtype))  # representable
    x = lo + np.sign(lo) * 0.25 * _spacing(lo, moment_dtype)  # exact in fp32
    hyper = hyper_rows(1e-3, 0.0, 0.0, 0.0, 1e-8, 0.0, 0.0)
    outs = []
    for seed in (step_seed(5, 1), step_seed(5, 1), step_seed(5, 2)):
        tensors = [[provider.randn((n,), "bfloat16")], [provider.from_numpy(x, "float32")],
                   [provider.zeros((n,), moment_dtype)], [provider.zeros((n,), moment_dtype)],
                   [provider.randn((n,), "float32")]]
        _launch(provider, tensors, hyper, seed=seed, stochastic_rounding=True)
        outs.append(provider.to_numpy(tensors[2][0]))
    np.testing.assert_array_equal(outs[0], outs[1])
    assert (outs[0] != outs[2]).mean() > 0.2
    err = (outs[0] - x) * np.sign(x) / _spacing(lo, moment_dtype)  # magnitude, in spacings: -1/4 or +3/4
    assert np.all(np.isclose(err, -0.25) | np.isclose(err, 0.75))
    assert abs(err.mean()) < 5 * np.sqrt(0.1875 / n), err.mean()


def test_stochastic_rounding_of_params_without_master_is_unbiased(provider):
    """bf16 params, no master: w = 1 - 0.3 * 2^-8 lies between 1 - 2^-8 and 1 (bf16 spacing below 1 is
    2^-8), 30% of the way down: nearest rounding always gives 1."""
    n = N_SR
    lr = 0.3 * 2.0**-8  # beta1 = beta2 = 0, g = 1: the step is -lr
    hyper = hyper_rows(lr, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0)
    tensors = [[provider.from_numpy(np.ones(n), "bfloat16")], [provider.from_numpy(np.ones(n), "bfloat16")],
               [provider.zeros((n,), "bfloat16")], [provider.zeros((n,), "bfloat16")], None]
    _launch(provider, tensors, hyper, stochastic_rounding=True)
    out = provider.to_numpy(tensors[0][0])
    expected = 1.0 - float(np.float32(lr))
    assert set(np.unique(out)) == {1.0 - 2.0**-8, 1.0}
    sigma = np.sqrt(0.3 * 0.7 / n) * 2.0**-8
    assert abs(out.mean() - expected) < 5 * sigma, (out.mean(), expected)
