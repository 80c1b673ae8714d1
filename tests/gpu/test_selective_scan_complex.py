"""Complex A on the CUDA selective scan (the kComplex kernels of csrc/selective_scan.cu) and on the
Triton one (kernels/triton/selective_scan.py, COMPLEX) against a float64 numpy recurrence with a
hand-written adjoint, itself checked against central differences.

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
from paddlenlp_fused.kernels.triton import selective_scan as scan_kernels
from paddlenlp_fused.runtime import tensor as T
from paddlenlp_fused.testing.numerics import as_pairs as _pairs, assert_close, assert_sum_close
from paddlenlp_fused.testing.scan_reference import selective_scan_reference

DTYPES = ("float32", "float16", "bfloat16")
BACKENDS = ("cuda", "triton")


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
# the kernels


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


def _triton_pairs(provider, t):
    """A complex64 tensor, or an input-dependent B/C's [.., 2 seqlen] (re, im) pairs, as the Triton
    launchers take them: float pairs along a trailing axis of stride 1 (copied where a strided view
    has none, as the op's contiguous inputs always have)."""
    if "complex" in str(t.dtype):
        return provider.torch.view_as_real(t) if provider.name == "torch" else provider.paddle.as_real(t)
    pairs = t.reshape(list(t.shape[:-1]) + [t.shape[-1] // 2, 2])
    return pairs if T.strides(pairs)[-1] == 1 else pairs.contiguous()


def run_complex_scan(provider, dev, softplus, dout, backend="cuda", deterministic=False, **options):
    """Forward and backward of ``backend``'s kernels (``options``: their tile options; ``deterministic``:
    Triton's partials), every output poisoned; (out, last, out_z, grads), complex ones complex64."""
    u = dev["u"]
    batch, dim, seqlen = u.shape
    dstate = dev["A"].shape[1]
    kernels = cuda_scan if backend == "cuda" else scan_kernels
    plan = kernels.scan_plan(seqlen)
    dtype = str(u.dtype).split(".")[-1]
    out = provider.poisoned(u.shape, dtype)
    if backend == "cuda":
        A, B, C = dev["A"], dev["B"], dev["C"]
        last = _poisoned(provider, (batch, dim, dstate), True)
        states = _poisoned(provider, cuda_scan.states_shape(batch, dim, dstate, plan), True)
        work = None
    else:
        A, B, C = (_triton_pairs(provider, dev[k]) for k in ("A", "B", "C"))
        last = provider.poisoned((batch, dim, dstate, 2), "float32")
        states = provider.poisoned(scan_kernels.states_shape(batch, dim, dstate, plan, True), "float32")
        work = provider.poisoned(scan_kernels.workspace_shape(batch, dim, dstate, plan, True), "float32")
    args = [u, dev["delta"], A, B, C]
    kernels.selective_scan_fwd(*args, out, dev["D"], dev["z"], dev["delta_bias"], states, last,
                               delta_softplus=softplus, plan=plan, **options)
    du, ddelta = provider.poisoned(u.shape, dtype), provider.poisoned(u.shape, dtype)
    dz = provider.poisoned(u.shape, dtype) if dev["z"] is not None else None
    out_z = provider.poisoned(u.shape, dtype) if dev["z"] is not None else None
    if backend == "cuda":
        acc = {k: None if dev[k] is None else _zeros(provider, dev[k]) for k in ("A", "B", "C", "D", "delta_bias")}
    else:
        acc = {k: provider.zeros(t.shape, "float32") for k, t in (("A", A), ("B", B), ("C", C))}
        acc.update({k: None if dev[k] is None else provider.zeros(dev[k].shape, "float32")
                    for k in ("D", "delta_bias")})
    if deterministic:
        layout = scan_kernels.bwd_partials_layout(u, A, B, C, dev["D"], dev["delta_bias"], plan, **options)
        options = dict(options, partials=provider.poisoned((layout["numel"],), "float32"))
    kernels.selective_scan_bwd(*args, dout, states, work, du, ddelta, acc["A"], acc["B"], acc["C"], dev["D"],
                               dev["z"], dev["delta_bias"], acc["D"], dz, acc["delta_bias"], out_z,
                               delta_softplus=softplus, plan=plan, **options)
    provider.synchronize()
    if backend == "triton":  # back from pairs: complex64, input-dependent dB/dC [.., 2 seqlen]
        last = _complex(provider, last)
        for k in ("A", "B", "C"):
            acc[k] = _complex(provider, acc[k]) if dev[k].ndim == 2 else acc[k].reshape(dev[k].shape)
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


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_complex_scan_fwd_bwd_match_float64(provider, shape, dtype, backend):
    batch, dim, seqlen, dstate, kind, options = shape
    rng = np.random.default_rng(hash((shape, dtype)) % 2**32)
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, kind, options, rng), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    results = run_complex_scan(provider, dev, options, dout, backend)
    check_complex_scan(provider, ref_in, options, dout, results, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_scan_strided_inputs(provider, backend):
    """u, delta, z, dout as [b, l, d] memory viewed as [b, d, l]; B, C pairs as [b, 2 l, n] viewed as
    [b, n, 2 l] (Triton takes them as contiguous pairs, as the op passes them); A as the transpose of a
    [n, d] tensor (element-wise loads throughout)."""
    batch, dim, seqlen, dstate, dtype = 2, 24, 333, 16, "bfloat16"
    rng = np.random.default_rng(7)
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, "variable", True, rng), dtype)
    for k in ("u", "delta", "z", "B", "C"):
        dev[k] = dev[k].transpose(1, 2).contiguous().transpose(1, 2)
    dev["A"] = dev["A"].transpose(0, 1).contiguous().transpose(0, 1)
    dout = provider.randn((batch, seqlen, dim), dtype).transpose(1, 2)
    results = run_complex_scan(provider, dev, True, dout, backend)
    check_complex_scan(provider, ref_in, True, dout, results, dtype)


@pytest.mark.parametrize("backend,options", [("cuda", dict(warps=w)) for w in (1, 2, 8)] +
                         [("triton", dict(block_d=b)) for b in (4, 64)], ids=str)
def test_complex_scan_block_sizes(provider, backend, options):
    """Dims a block other than the defaults (CUDA: 8 warps is capped at 4 in the complex backward;
    Triton: blocks of 4 dims, and of 64, past dim)."""
    batch, dim, seqlen, dstate, dtype = 2, 40, 600, 16, "float32"
    rng = np.random.default_rng(sorted(options.values())[0])
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, "variable", True, rng), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    results = run_complex_scan(provider, dev, True, dout, backend, **options)
    check_complex_scan(provider, ref_in, True, dout, results, dtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_complex_scan_long_sequence(provider, backend):
    """seqlen 8192 (32 CUDA backward chunks, 11 Triton segments), bf16, every option."""
    batch, dim, seqlen, dstate, dtype = 1, 16, 8192, 16, "bfloat16"
    rng = np.random.default_rng(3)
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, "grouped", True, rng), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    results = run_complex_scan(provider, dev, True, dout, backend)
    check_complex_scan(provider, ref_in, True, dout, results, dtype)


@pytest.mark.parametrize("kind", ("variable", "fixed", "grouped"))
def test_triton_complex_scan_deterministic_bit_identical(provider, kind):
    """Triton's partials path with complex A (pairs in every per-program slot): several programs add
    into every accumulated gradient (4 batch rows; blocks of 4 dims, 3 of a group); within float64's
    bounds, and two runs bit-identical in every gradient."""
    batch, dim, seqlen, dstate, dtype = 4, 48, 777, 8, "bfloat16"
    rng = np.random.default_rng(len(kind))
    dev, ref_in = _device_case(provider, _numpy_case(batch, dim, seqlen, dstate, kind, True, rng), dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    runs = [run_complex_scan(provider, dev, True, dout, "triton", deterministic=True, block_d=4) for _ in range(2)]
    check_complex_scan(provider, ref_in, True, dout, runs[0], dtype)
    for name, g in runs[0][3].items():
        if g is not None:
            assert np.array_equal(_to_numpy(provider, g), _to_numpy(provider, runs[1][3][name])), \
                f"{name}: two deterministic runs differ"


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
