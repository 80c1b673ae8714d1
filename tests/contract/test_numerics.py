"""testing.numerics.assert_close: the elementwise check next to the norm-wise one."""

import numpy as np
import pytest

from paddlenlp_fused.testing.numerics import (ELEMENTWISE_FACTOR, RATIO_LOG_ENV, assert_close, bound_for, max_err,
                                              rel_err)


@pytest.fixture(autouse=True)
def _no_ratio_log(monkeypatch):
    """These checks fail on purpose: they stay out of a flake hunt's log."""
    monkeypatch.delenv(RATIO_LOG_ENV, raising=False)


def _rounded(ref, u):
    return ref.astype(np.float64) * (1 + np.random.uniform(-u, u, ref.shape))


def test_one_wrong_row_fails_though_the_norm_passes():
    ref = np.random.randn(65536, 8)
    out = _rounded(ref, 2.0**-8)
    assert_close("rounded", out, ref, "bfloat16")
    out[4321] = 0.0
    assert rel_err(out, ref) <= bound_for("bfloat16")  # the norm-wise bound alone would pass it
    with pytest.raises(AssertionError, match=r"largest error .* \(at \(4321, \d\)\)"):
        assert_close("one row zeroed", out, ref, "bfloat16")


@pytest.mark.parametrize("dtype,u", [("float32", 2.0**-24), ("float16", 2.0**-11), ("bfloat16", 2.0**-8)])
def test_rounding_errors_pass_and_nan_fails(dtype, u):
    ref = np.random.randn(257, 33) * np.exp(np.random.randn(257, 1))  # rows of very different scales
    out = _rounded(ref, u)
    assert_close("rounded", out, ref, dtype)
    worst, _ = max_err(out, ref)
    assert worst <= ELEMENTWISE_FACTOR * bound_for(dtype)
    out[3, 4] = np.nan
    with pytest.raises(AssertionError):
        assert_close("nan", out, ref, dtype)


def test_zero_and_empty_references():
    assert max_err(np.zeros(4), np.zeros(4)) == (0.0, (0,))
    assert max_err(np.zeros((0, 3)), np.zeros((0, 3))) == (0.0, ())
    assert_close("zero ref", np.array([0.0, 5e-6, 0.0, 0.0]), np.zeros(4), "float32")
    with pytest.raises(AssertionError):
        assert_close("zero ref", np.array([0.0, 1e-4, 0.0, 0.0]), np.zeros(4), "float32")
