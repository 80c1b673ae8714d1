"""Complex A on the CUDA selective scan (the kComplex kernels of csrc/selective_scan.cu) against a
float64 numpy recurrence with a hand-written adjoint, itself checked against central differences.

mamba_ssm's convention: A complex [dim, dstate]; fixed B/C complex [dim, dstate]; input-dependent
B/C real [batch, (groups,) dstate, 2 * seqlen] holding (re, im) pairs; y = 2 Re(sum_n C h) + D u.
Gradients of complex tensors are dL/dre + i dL/dim (torch's and Paddle's convention) and are
compared by relative norm on their (re, im) pairs; the gradients that sum one term per token (dA,
fixed dB/dC, dD, ddelta_bias), where they cancel, by their error over the sum of the terms' magnitudes
(DESIGN.md's note on sums). Outputs are poisoned (NaN) first.
"""

import numpy as np
import pytest

from paddlenlp_fused.kernels.cuda import selective_scan as cuda_scan
from paddlenlp_fused.testing.numerics import as_pairs as _pairs, assert_close, assert_sum_close
from paddlenlp_fused.testing.scan_reference import selective_scan_reference

DTYPES = ("float32", "float16", "bfloat16")


def _numpy_case(batch, dim, seqlen, dstate, kind, options, rng):
    """Float64 inputs: kind names how B and C come (see KINDS)."""
    groups = {"grouped": 4, "grouped3": 3}.get(kind, 1)
    B_kind, C_kind = KINDS[kind]

    def bc(which):
        if which == "fixed":
            return rng.standard_normal((dim, dstate)) + 1j * rng.standard_normal((dim, dstate))
        shape = (batch, dstate, 2 * seqlen) if groups == 1 else (batch, groups, dstate, 2 * seqlen)
        return rng.standard_normal(shape)
    t = dict(u=rng.standard_normal((batch, dim, seqlen)),
             # a step size: through softplus when ``options``, else drawn positive
             delta=rng.standard_normal((batch, dim, seqlen)) * 0.5 - 1.0 if options else
             np.abs(rng.standard_normal((batch, dim, seqlen))) * 0.5 + 0.05,
             # decaying (negative real part), oscillating (imaginary part up to a few radians a step)
             A=-np.exp(rng.standard_normal((dim, dstate)) * 0.5) + 3j * rng.standard_normal((dim, dstate)),
             B=bc(B_kind), C=bc(C_kind))
    t.update(D=rng.standard_normal(dim) if options else None,
             z=rng.standard_normal((batch, dim, seqlen)) if options else None,
             delta_bias=rng.standard_normal(dim) * 0.3 if options else None)
    return t


# (B, C) kinds of each case name
KINDS = {"variable": ("variable", "variable"), "fixed": ("fixed", "fixed"), "grouped": ("variable", "variable"),
         "grouped3": ("variable", "variable"), "fixedB": ("fixed", "variable"), "fixedC": ("variable", "fixed")}


def test_reference_adjoint_matches_central_differences():
    """The hand-written adjoint above against central differences of its own forward (float64, no GPU)."""
    rng = np.random.default_rng(0)
    for kind in ("variable", "fixed", "grouped3"):
        t = _numpy_case(2, 3, 5, 2, kind, True, rng)
        dout = rng.standard_normal((2, 3, 5))
        _, _, grads, _ = selective_scan_reference(**t, softplus=True, dout=dout)

        def loss(**changed):
            out, _ = selective_scan_reference(**dict(t, **changed), softplus=True)
            return float((out * dout).sum())

        eps = 1e-6
        for name in ("u", "delta", "A", "B", "C", "D", "z", "delta_bias"):
            x = t[name]
            numeric = np.zeros_like(x)
            for idx in np.ndindex(x.shape):
                for unit in ((1, 1j) if np.iscomplexobj(x) else (1,)):
                    step = np.zeros_like(x)
                    step[idx] = eps * unit
                    diff = (loss(**{name: x + step}) - loss(**{name: x - step})) / (2 * eps)
                    numeric[idx] += diff * unit  # dL/dre + i dL/dim
            key = {"u": "du", "delta": "ddelta", "z": "dz", "delta_bias": "ddelta_bias"}.get(name, "d" + name)
            np.testing.assert_allclose(grads[key], numeric, rtol=1e-6, atol=1e-7, err_msg=f"{kind} {key}")


# ----------------------------------------------------------------------------------------------
# the CUDA kernels


def _complex(provider, pairs):
    """A complex64 view of a float32 [..., 2] device tensor."""
    if provider.name == "torch":
        return provider.torch.view_as_complex(pairs)
    return provider.paddle.as_complex(pairs)


def _to_numpy(provider, t):
    """float64 (complex128 for a complex64 tensor) numpy copy."""
    if "complex" not in str(t.dtype):
        return provider.to_numpy(t)
    pairs = provider.torch.view_as_real(t) if provider.name == "torch" else provider.paddle.as_real(t)
    pairs = provider.to_numpy(pairs)
    return pairs[..., 0] + 1j * pairs[..., 1]


def _device(provider, x, dtype):
    """A numpy input on the device: complex arrays as complex64, real ones in ``dtype``."""
    if x is None:
        return None
    if np.iscomplexobj(x):
        return _complex(provider, provider.from_numpy(np.stack([x.real, x.imag], -1), "float32"))
    return provider.from_numpy(x, dtype)


def _device_case(provider, t, dtype):
    """The kernels' inputs (activations and input-dependent B/C in ``dtype``, the rest float32 /
    complex64) and their float64 values after rounding (the reference's inputs)."""
    activation = ("u", "delta", "z")
    dev = {k: _device(provider, v, dtype if k in activation or (k in ("B", "C") and v.ndim > 2) else "float32")
           for k, v in t.items()}
    return dev, {k: None if v is None else _to_numpy(provider, v) for k, v in dev.items()}


def _poisoned(provider, shape, complex_):
    if complex_:
        return _complex(provider, provider.poisoned(tuple(shape) + (2,), "float32"))
    return provider.poisoned(shape, "float32")


def _zeros(provider, like):
    complex_ = "complex" in str(like.dtype)
    if complex_:
        return _complex(provider, provider.zeros(tuple(like.shape) + (2,), "float32"))
    return provider.zeros(like.shape, "float32")


def run_complex_scan(provider, dev, softplus, dout, warps=0):
    """Forward and backward of the CUDA kernels, every output poisoned; (out, last, out_z, grads)."""
    u = dev["u"]
    batch, dim, seqlen = u.shape
    dstate = dev["A"].shape[1]
    plan = cuda_scan.scan_plan(seqlen)
    dtype = str(u.dtype).split(".")[-1]
    out, last = provider.poisoned(u.shape, dtype), _poisoned(provider, (batch, dim, dstate), True)
    states = _poisoned(provider, cuda_scan.states_shape(batch, dim, dstate, plan), True)
    args = [dev[k] for k in ("u", "delta", "A", "B", "C")]
    cuda_scan.selective_scan_fwd(*args, out, dev["D"], dev["z"], dev["delta_bias"], states, last,
                                 delta_softplus=softplus, plan=plan, warps=warps)
    du, ddelta = provider.poisoned(u.shape, dtype), provider.poisoned(u.shape, dtype)
    dz = provider.poisoned(u.shape, dtype) if dev["z"] is not None else None
    out_z = provider.poisoned(u.shape, dtype) if dev["z"] is not None else None
    acc = {k: None if dev[k] is None else _zeros(provider, dev[k]) for k in ("A", "B", "C", "D", "delta_bias")}
    cuda_scan.selective_scan_bwd(*args, dout, states, None, du, ddelta, acc["A"], acc["B"], acc["C"], dev["D"],
                                 dev["z"], dev["delta_bias"], acc["D"], dz, acc["delta_bias"], out_z,
                                 delta_softplus=softplus, plan=plan, warps=warps)
    provider.synchronize()
    return out, last, out_z, dict(du=du, ddelta=ddelta, dA=acc["A"], dB=acc["B"], dC=acc["C"], dD=acc["D"],
                                  dz=dz, ddelta_bias=acc["delta_bias"])


def check_complex_scan(provider, ref_in, softplus, dout, results, dtype):
    out, last, out_z, grads = results
    ref_out, ref_last, ref_grads, term_sums = selective_scan_reference(**ref_in, softplus=softplus,
                                                                     dout=provider.to_numpy(dout))
    assert_close("out", provider.to_numpy(out), ref_out, dtype)
    assert_close("last_state", _pairs(_to_numpy(provider, last)), _pairs(ref_last), dtype)
    if out_z is not None:
        assert_close("out_z", provider.to_numpy(out_z), ref_out, dtype)
    for name, g in grads.items():
        if g is None:
            continue
        if name in term_sums:
            assert_sum_close(name, _to_numpy(provider, g), ref_grads[name], term_sums[name], dtype)
        else:
            assert_close(name, _pairs(_to_numpy(provider, g)), _pairs(ref_grads[name]), dtype)


# (batch, dim, seqlen, dstate, kind, options). The backward walks 256-step chunks in reverse (seqlen
# 1000: 4, the last partial); a complex forward lane holds 8 steps. grouped: 12 dims a group (blocks of
# 4 warps), grouped3: 15 (blocks of one warp). Rows of 1024 (and fp32 rows of 300) take the vector
# loads and, for input-dependent dB/dC, the vector atomics; the others the element-wise paths.
SHAPES = [
    (1, 1, 1, 1, "variable", True),
    (2, 37, 300, 16, "variable", True),
    (3, 64, 1000, 4, "fixed", False),
    (2, 48, 257, 16, "grouped", True),
    (2, 45, 520, 8, "grouped3", True),
    (1, 20, 513, 64, "fixedB", False),
    (2, 24, 1024, 16, "fixedC", True),
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_complex_scan_fwd_bwd_match_float64(provider, shape, dtype):
    batch, dim, seqlen, dstate, kind, options = shape
    rng = np.random.default_rng(hash((shape, dtype)) % 2**32)
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, kind, options, rng), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    results = run_complex_scan(provider, dev, options, dout)
    check_complex_scan(provider, ref_in, options, dout, results, dtype)


def test_complex_scan_strided_inputs(provider):
    """u, delta, z, dout as [b, l, d] memory viewed as [b, d, l]; B, C pairs as [b, 2 l, n] viewed as
    [b, n, 2 l]; A as the transpose of a [n, d] tensor (element-wise loads throughout)."""
    batch, dim, seqlen, dstate, dtype = 2, 24, 333, 16, "bfloat16"
    rng = np.random.default_rng(7)
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, "variable", True, rng), dtype)
    for k in ("u", "delta", "z", "B", "C"):
        dev[k] = dev[k].transpose(1, 2).contiguous().transpose(1, 2)
    dev["A"] = dev["A"].transpose(0, 1).contiguous().transpose(0, 1)
    dout = provider.randn((batch, seqlen, dim), dtype).transpose(1, 2)
    results = run_complex_scan(provider, dev, True, dout)
    check_complex_scan(provider, ref_in, True, dout, results, dtype)


@pytest.mark.parametrize("warps", [1, 2, 8])
def test_complex_scan_block_sizes(provider, warps):
    """Dims a block other than the defaults (8 is capped at 4 in the complex backward)."""
    batch, dim, seqlen, dstate, dtype = 2, 40, 600, 16, "float32"
    rng = np.random.default_rng(warps)
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, "variable", True, rng), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    results = run_complex_scan(provider, dev, True, dout, warps=warps)
    check_complex_scan(provider, ref_in, True, dout, results, dtype)


def test_complex_scan_long_sequence(provider):
    """seqlen 8192 (32 backward chunks), bf16, every option."""
    batch, dim, seqlen, dstate, dtype = 1, 16, 8192, 16, "bfloat16"
    rng = np.random.default_rng(3)
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, "grouped", True, rng), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    results = run_complex_scan(provider, dev, True, dout)
    check_complex_scan(provider, ref_in, True, dout, results, dtype)


def test_complex_launcher_refuses_mismatched_kinds(provider):
    """Real fixed B with complex A, complex B with real A, float32 states with complex A: TypeError
    before any launch."""
    batch, dim, seqlen, dstate = 1, 4, 16, 2
    rng = np.random.default_rng(1)
    dev, _ = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, "fixed", False, rng), "float32")
    out = provider.empty((batch, dim, seqlen), "float32")
    real_fixed = provider.randn((dim, dstate), "float32")
    with pytest.raises(TypeError, match="B: expected complex64"):
        cuda_scan.selective_scan_fwd(dev["u"], dev["delta"], dev["A"], real_fixed, dev["C"], out)
    with pytest.raises(TypeError, match="C: expected a real float dtype"):
        cuda_scan.selective_scan_fwd(dev["u"], dev["delta"], real_fixed, real_fixed, dev["C"], out)
    plan = cuda_scan.scan_plan(seqlen)
    states32 = provider.empty(cuda_scan.states_shape(batch, dim, dstate, plan), "float32")
    with pytest.raises(TypeError, match="states: expected complex64"):
        cuda_scan.selective_scan_fwd(dev["u"], dev["delta"], dev["A"], dev["B"], dev["C"], out, states=states32)
