"""Relative-error checks of DESIGN.md: ``||out - ref|| / ||ref||`` in float64, NaN never passes.

float32 outputs must be within 1e-5 (1e-3 where tf32 matrix units are used, said by the caller).
float16/bfloat16 outputs must be under 1e-2 and within 2x the error of the plain computation in
that dtype. Where no plain computation is at hand (or it is better than one rounding), the baseline
is the dtype's unit roundoff ``u`` (2^-8 for bfloat16, 2^-11 for float16): merely rounding the exact
result to the dtype costs up to ``u`` per element, and a plain composition rounds several times.

``assert_close`` pairs that norm-wise bound with an elementwise one, ``max|out - ref| <=
ELEMENTWISE_FACTOR * bound * max|ref|``: a norm-wise bound lets one wrong row of a large tensor pass
(its share of the norm shrinks with the number of rows), while the largest error is measured against
the largest reference value, whatever the size. Scaling by ``max|ref|`` rather than by each
element keeps it robust where an element's error follows its terms rather than its own (small)
value, and tying it to the norm-wise bound gives it that bound's dtype and baseline. The factor
comes from two runs of the CPU suite (4316 calls, each test a fresh seed): the largest
``max|out - ref| / (bound * max|ref|)`` was 0.35 for float32, 0.85 for float16 and 1.07 for
bfloat16; rounding errors scale with the values they round, so that ratio does not grow with the
tensor's size as a tail would (0.64 at most over the tensors of 10^4 elements and more). 4 leaves a
margin of 3.7 over the worst and still fails a row that is off by 4% (bfloat16) or 4e-5 (float32)
of the tensor's largest value.
"""

from __future__ import annotations

import json
import os

import numpy as np

FP32_BOUND = 1e-5
TF32_BOUND = 1e-3
LOW_PRECISION_CAP = 1e-2
UNIT_ROUNDOFF = {"float16": 2.0**-11, "bfloat16": 2.0**-8}
ELEMENTWISE_FACTOR = 4.0
RATIO_LOG_ENV = "PADDLENLP_FUSED_RATIO_LOG"
current_test = ""  # set per test by tests/conftest.py, for the ratio log


def _log_ratios(name: str, norm_ratio: float, elementwise_ratio: float | None = None) -> None:
    """Append each check's error / bound (norm-wise, elementwise) to the JSON-lines file named by
    PADDLENLP_FUSED_RATIO_LOG, so a flake hunt over many seeds sees how close each check comes to its
    bound (``python -m paddlenlp_fused.testing.ratios LOG``); nothing when it is unset."""
    path = os.environ.get(RATIO_LOG_ENV)
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"test": current_test, "check": name, "norm": norm_ratio,
                                "elementwise": elementwise_ratio}) + "\n")


def rel_err(out, ref) -> float:
    """Relative norm error of ``out`` against ``ref`` (array-likes); inf when out has NaN/inf."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {out.shape} vs reference {ref.shape}")
    if not np.all(np.isfinite(out)):
        return float("inf")
    denom = np.linalg.norm(ref)
    diff = np.linalg.norm(out - ref)
    return float(diff / denom) if denom > 0 else float(diff)


def bound_for(dtype: str, baseline_err: float | None = None, tf32: bool = False) -> float:
    """The relative error an output of ``dtype`` may have against the float64 reference."""
    if dtype == "float32":
        return TF32_BOUND if tf32 else FP32_BOUND
    if dtype not in UNIT_ROUNDOFF:
        raise ValueError(f"dtype: unsupported {dtype!r}")
    return min(LOW_PRECISION_CAP, 2.0 * max(UNIT_ROUNDOFF[dtype], baseline_err or 0.0))


def max_err(out, ref) -> tuple:
    """(``max|out - ref| / max|ref|``, the index of the largest error) in float64; the ratio is the
    plain largest error when ref is all zeros, inf when out has NaN/inf."""
    out = np.asarray(out, dtype=np.float64)
    ref = np.asarray(ref, dtype=np.float64)
    if out.shape != ref.shape:
        raise AssertionError(f"shape mismatch: {out.shape} vs reference {ref.shape}")
    if out.size == 0:
        return 0.0, ()
    if not np.all(np.isfinite(out)):
        return float("inf"), np.unravel_index(int(np.argmin(np.isfinite(out))), out.shape)
    diff = np.abs(out - ref)
    index = np.unravel_index(int(np.argmax(diff)), out.shape)
    scale = float(np.max(np.abs(ref)))
    return (float(diff[index]) / scale if scale > 0 else float(diff[index])), tuple(int(i) for i in index)


def assert_close(name: str, out, ref, dtype: str, baseline_err: float | None = None, tf32: bool = False) -> float:
    """Assert DESIGN.md's bound, norm-wise and elementwise (module docstring); returns the norm-wise
    error."""
    err = rel_err(out, ref)
    bound = bound_for(dtype, baseline_err, tf32)
    worst, index = max_err(out, ref)
    _log_ratios(f"{name} ({dtype})", err / bound, worst / (ELEMENTWISE_FACTOR * bound))
    if not err <= bound:  # also false for NaN
        raise AssertionError(f"{name} ({dtype}): relative error {err:.3e} exceeds bound {bound:.3e}")
    if not worst <= ELEMENTWISE_FACTOR * bound:
        raise AssertionError(f"{name} ({dtype}): largest error {worst:.3e} of max|ref| (at {index}) exceeds "
                             f"{ELEMENTWISE_FACTOR:g} x bound {bound:.3e}")
    return err


def _error_over_terms(out, ref, term_magnitudes) -> float:
    """max |out - ref| / (sum of the terms' magnitudes), elementwise; real or complex."""
    wide = lambda a: np.asarray(a).astype(np.complex128 if np.iscomplexobj(a) else np.float64)  # noqa: E731
    diff = np.abs(wide(out) - wide(ref))
    return float(np.max(diff / np.maximum(np.asarray(term_magnitudes, dtype=np.float64), 1e-300)))


def assert_close_to_terms(name: str, out, ref, term_magnitudes, dtype: str) -> float:
    """Assert DESIGN.md's bound for a sum that may cancel: the error of each element over the sum of
    its terms' magnitudes (``term_magnitudes``, broadcastable to ``out``), not over the sum itself.
    Real or complex. Returns the largest such ratio."""
    err = _error_over_terms(out, ref, term_magnitudes)
    bound = bound_for(dtype)
    _log_ratios(f"{name} ({dtype}) over terms", err / bound)
    if not err <= bound:  # also false for NaN
        raise AssertionError(f"{name} ({dtype}): error / sum of |terms| {err:.3e} exceeds bound {bound:.3e}")
    return err


def assert_within(name: str, out, ref, limit: float) -> float:
    """Norm-wise within ``limit`` and elementwise within ELEMENTWISE_FACTOR times it (as
    ``assert_close``, for a limit that is not one dtype's bound); returns the norm-wise error."""
    err, (worst, index) = rel_err(out, ref), max_err(out, ref)
    _log_ratios(name, err / limit, worst / (ELEMENTWISE_FACTOR * limit))
    assert err <= limit and worst <= ELEMENTWISE_FACTOR * limit, \
        f"{name}: relative error {err:.3e}, largest {worst:.3e} of max|ref| (at {index}); limit {limit:.3e}"
    return err


def as_pairs(x):
    """A complex array as its (re, im) pairs, so complex values are compared by relative norm."""
    x = np.asarray(x)
    return np.stack([x.real, x.imag], -1) if np.iscomplexobj(x) else x


def assert_sum_close(name: str, out, ref, term_magnitudes, dtype: str) -> float:
    """A gradient that sums one term per token (dA, dD, ddelta_bias, a fixed B/C): its relative norm
    error, or, where the sum cancels (its norm far below its terms'), DESIGN.md's measure for sums,
    the error over the sum of the terms' magnitudes (``assert_close_to_terms``). Either passes it, so
    the ratio logged is the smaller of the two."""
    err = rel_err(as_pairs(out), as_pairs(ref))
    if err <= bound_for(dtype):
        over_terms = _error_over_terms(out, ref, term_magnitudes)
        _log_ratios(f"{name} ({dtype})", min(err, over_terms) / bound_for(dtype))
        return err
    return assert_close_to_terms(name, out, ref, term_magnitudes, dtype)


def assert_sum_within(name: str, out, ref, term_magnitudes, limit: float, dtype: str = "float32") -> float:
    """``assert_sum_close`` with ``assert_within``'s first measure: a gradient that sums terms over
    every token passes norm-wise within ``limit`` and elementwise within ELEMENTWISE_FACTOR times it,
    or, where the sum cancels far below its terms, with each element's error within ``dtype``'s bound
    of the sum of its terms' magnitudes (DESIGN.md's measure for sums). Either passes it (NaN or inf
    neither), so the ratio logged, and returned, is the smaller of the two."""
    err, (worst, index) = rel_err(out, ref), max_err(out, ref)
    by_norm = max(err / limit, worst / (ELEMENTWISE_FACTOR * limit))
    by_terms = _error_over_terms(out, ref, term_magnitudes) / bound_for(dtype)
    ratio = by_terms if by_terms < by_norm else by_norm  # (by_norm is inf where out is not finite)
    _log_ratios(f"{name} ({dtype}, sum over tokens)", ratio)
    if not (by_norm <= 1 or by_terms <= 1):
        raise AssertionError(f"{name}: relative error {err:.3e}, largest {worst:.3e} of max|ref| (at {index}), "
                             f"limit {limit:.3e}; error / sum of |terms| {by_terms * bound_for(dtype):.3e}, "
                             f"bound {bound_for(dtype):.3e}")
    return ratio


def silu(x):
    """numpy silu, for float64 references."""
    return x / (1 + np.exp(-x))


def dsilu(x):
    """numpy derivative of silu."""
    s = 1 / (1 + np.exp(-x))
    return s * (1 + x * (1 - s))
