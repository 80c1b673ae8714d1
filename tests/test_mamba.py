"""Mamba-1: selective scan, causal conv1d, decoding steps, mamba_inner_fn and MambaMixer.

Triton kernels run in the interpreter through the Paddle ops (and launchers directly for strides,
poisoned outputs and many chunk/segment boundaries); both backends are checked against float64
recurrences written here independently of the library (sequential scan, ``F.conv1d`` conv).
Shapes are tiny (the interpreter runs the custom-combine scan element by element) but odd: dim 6,
dstate 3, seqlen 37 crosses chunk (8) and segment boundaries of the scan."""

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddlenlp_fused.kernels.cuda import selective_scan as cuda_scan
from paddlenlp_fused.kernels.triton import causal_conv1d as conv_kernels
from paddlenlp_fused.kernels.triton import selective_scan as scan_kernels
from paddlenlp_fused.layers.mamba import MambaInferenceCache, MambaMixer
from paddlenlp_fused.ops.causal_conv1d import causal_conv1d_fn, causal_conv1d_update
from paddlenlp_fused.ops import mamba as mamba_ops
from paddlenlp_fused.ops.mamba import (_cuda_dtype_issue, _scan_unsupported, mamba_inner_fn, selective_scan_fn,
                                       selective_state_update)
from paddlenlp_fused.reference.mamba import mamba_inner_ref, selective_scan_ref
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import as_pairs, assert_close, assert_sum_close
from paddlenlp_fused.testing.scan_reference import selective_scan_reference
from helpers import as_leaf64, deterministic_settings, randn, to64

BACKENDS = ("triton", "reference")


# ----------------------------------------------------------------------------------------------
# float64 ground truth (written here, independent of paddlenlp_fused.reference)


def _bc_at(M, t, dim):
    """B or C at step t as a tensor broadcastable to [batch, dim, dstate]."""
    if M.ndim == 2:
        return M[None]
    if M.ndim == 3:
        return M[:, None, :, t]
    per_group = dim // M.shape[1]
    return paddle.index_select(M[:, :, :, t], paddle.to_tensor(np.arange(dim) // per_group), axis=1)


def scan64(u, delta, A, B, C, D=None, z=None, delta_bias=None, softplus=False):
    """Sequential recurrence in float64 (complex128 for complex A): (y, last state)."""
    batch, dim, seqlen = u.shape
    dt = delta if delta_bias is None else delta + delta_bias[:, None]
    if softplus:
        dt = paddle.where(dt > 20, dt, paddle.log1p(paddle.exp(dt)))
    cplx = A.dtype == paddle.complex128
    if cplx:
        dt, uc = dt.astype("complex128"), u.astype("complex128")
    else:
        uc = u
    h = paddle.zeros([batch, dim, A.shape[1]], dtype=A.dtype)
    ys = []
    for t in range(seqlen):
        h = paddle.exp(dt[:, :, t, None] * A) * h + (dt[:, :, t] * uc[:, :, t])[:, :, None] * _bc_at(B, t, dim)
        ys.append((h * _bc_at(C, t, dim)).sum(-1))
    y = paddle.stack(ys, axis=-1)
    if cplx:
        y = paddle.real(y) * 2
    if D is not None:
        y = y + D[:, None] * u
    if z is not None:
        y = y * z * F.sigmoid(z)
    return y, h


def conv64(x, weight, bias=None, initial_states=None, activation=None):
    """Depthwise causal conv in float64 with paddle's conv1d on the left-padded input."""
    batch, dim, _ = x.shape
    width = weight.shape[1]
    pad = initial_states if initial_states is not None else paddle.zeros([batch, dim, width - 1], dtype=x.dtype)
    out = F.conv1d(paddle.concat([pad, x], axis=-1), weight[:, None, :], bias, groups=dim)
    return out * F.sigmoid(out) if activation == "silu" else out


def _grads(out, inputs, dout):
    wanted = [t for t in inputs if t is not None and not t.stop_gradient]
    return paddle.grad(out, wanted, dout)


def _leaf(shape, dtype="float32", scale=1.0, offset=0.0):
    t = paddle.to_tensor((np.random.randn(*shape) * scale + offset).astype(np.float32)).astype(dtype)
    t.stop_gradient = False
    return t


def _check_all(names, got, want, dtype):
    for name, g, w in zip(names, got, want):
        assert_close(name, to64(g), w.numpy(), dtype)


# ----------------------------------------------------------------------------------------------
# selective scan

SCAN_CASES = {
    # B/C input-dependent, every option on
    "variable": dict(dtype="float32", B="variable", C="variable", D=True, z=True, bias=True, softplus=True),
    # fixed B, grouped C, no D/z/bias, fp16 activations
    "fixed-grouped": dict(dtype="float16", B="fixed", C="grouped", D=False, z=False, bias=False, softplus=False),
    "bf16": dict(dtype="bfloat16", B="variable", C="variable", D=True, z=True, bias=True, softplus=True),
}


def _scan_inputs(case, batch=2, dim=6, dstate=3, seqlen=37, groups=3):
    dtype = case["dtype"]
    shapes = {"fixed": (dim, dstate), "variable": (batch, dstate, seqlen), "grouped": (batch, groups, dstate, seqlen)}
    u = _leaf((batch, dim, seqlen), dtype)
    delta = _leaf((batch, dim, seqlen), dtype, scale=0.5, offset=-0.5)
    if not case["softplus"]:  # the step itself must be positive, as Mamba's is: a negative one grows the
        delta = F.softplus(delta.astype("float32")).astype(dtype).detach()  # state exponentially, past fp16's range
        delta.stop_gradient = False
    A = paddle.to_tensor(-np.exp(np.random.randn(dim, dstate) * 0.5).astype(np.float32))
    A.stop_gradient = False
    B = _leaf(shapes[case["B"]], dtype if case["B"] != "fixed" else "float32")
    C = _leaf(shapes[case["C"]], dtype if case["C"] != "fixed" else "float32")
    D = _leaf((dim,)) if case["D"] else None
    z = _leaf((batch, dim, seqlen), dtype) if case["z"] else None
    bias = _leaf((dim,), scale=0.3) if case["bias"] else None
    return [u, delta, A, B, C, D, z, bias]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(SCAN_CASES))
def test_selective_scan_matches_float64(name, backend):
    case = SCAN_CASES[name]
    ins = _scan_inputs(case)
    out, last = selective_scan_fn(*ins, delta_softplus=case["softplus"], return_last_state=True, backend=backend)
    assert out.dtype == ins[0].dtype and last.dtype == paddle.float32 and last.stop_gradient
    dout = randn(out.shape, case["dtype"])
    grads = _grads(out, ins, dout)

    ins64 = [None if t is None else as_leaf64(t) for t in ins]
    y64, h64 = scan64(*ins64, softplus=case["softplus"])
    grads64 = _grads(y64, ins64, paddle.to_tensor(to64(dout)))
    dtype = case["dtype"]
    assert_close("out", to64(out), y64.numpy(), dtype)
    assert_close("last_state", last.numpy(), h64.numpy(), "float32")
    names = [n for n, t in zip(["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"], ins) if t is not None]
    # gradients of fp32 parameters (A, fixed B/C, D, delta_bias) are fp32 sums of low-precision terms
    _check_all(names, grads, grads64, dtype)


def test_scan_launchers_cross_many_chunks_and_segments():
    """Launchers directly: chunks of 4 in segments of 2 (10 chunks, 5 segments, the last partial),
    every output poisoned with NaN."""
    case = SCAN_CASES["variable"]
    u, delta, A, B, C, D, z, bias = (t.detach() for t in _scan_inputs(case, seqlen=37))
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    plan = scan_kernels.scan_plan(seqlen, chunk=4, seg_chunks=2)
    assert (plan.n_chunks, plan.n_segments) == (10, 5)
    nan = lambda shape: paddle.full(list(shape), float("nan"), dtype="float32")  # noqa: E731
    out, last = nan(u.shape), nan((batch, dim, dstate))
    states = nan(scan_kernels.states_shape(batch, dim, dstate, plan))
    scan_kernels.selective_scan_fwd(*triton_args(u, delta, A, B, C, out, D, z, bias, states, last),
                                    delta_softplus=True, plan=plan)
    dout = randn(u.shape)
    du, ddelta, dz, out_z = (nan(u.shape) for _ in range(4))
    work = nan(scan_kernels.workspace_shape(batch, dim, dstate, plan))
    acc = [paddle.zeros(list(t.shape), dtype="float32") for t in (A, B, C, D, bias)]
    scan_kernels.selective_scan_bwd(*triton_args(u, delta, A, B, C, dout, states, work, du, ddelta, acc[0], acc[1],
                                                 acc[2], D, z, bias, acc[3], dz, acc[4], out_z),
                                    delta_softplus=True, plan=plan)
    ins64 = [as_leaf64(t) for t in (u, delta, A, B, C, D, z, bias)]
    y64, h64 = scan64(*ins64, softplus=True)
    grads64 = paddle.grad(y64, ins64, paddle.to_tensor(to64(dout)))
    assert_close("out", out.numpy(), y64.numpy(), "float32")
    assert_close("out_z", out_z.numpy(), y64.numpy(), "float32")
    assert_close("last_state", last.numpy(), h64.numpy(), "float32")
    _check_all(["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"],
               [du, ddelta, acc[0], acc[1], acc[2], acc[3], dz, acc[4]], grads64, "float32")


def _complex_inputs(batch=2, dim=4, dstate=3, seqlen=9):
    """u, delta, complex A, real (re, im)-interleaved input-dependent B, fixed complex C."""
    u, delta = _leaf((batch, dim, seqlen)), _leaf((batch, dim, seqlen), scale=0.3, offset=0.2)
    A = paddle.complex(_leaf((dim, dstate), offset=-1.0).detach(), _leaf((dim, dstate)).detach())
    C = paddle.complex(_leaf((dim, dstate)).detach(), _leaf((dim, dstate)).detach())
    A.stop_gradient = C.stop_gradient = False
    return u, delta, A, _leaf((batch, dstate, 2 * seqlen)), C


def test_complex_A_on_the_reference_path():
    """Complex A (mamba_ssm's convention: output 2 Re(C h)); fixed complex C and variable real
    (re, im)-interleaved B. Every backend takes it (CUDA and Triton: tests/gpu, and below)."""
    u, delta, A, B_pairs, C = _complex_inputs()
    batch, dstate = u.shape[0], A.shape[1]
    out = selective_scan_fn(u, delta, A, B_pairs, C, backend="reference")
    du, dB = paddle.grad(out, [u, B_pairs], paddle.ones_like(out))
    u64, delta64, B64 = as_leaf64(u), as_leaf64(delta), as_leaf64(B_pairs)
    Bc = paddle.complex(B64[..., 0::2], B64[..., 1::2])
    y64, _ = scan64(u64, delta64, A.astype("complex128"), Bc, C.astype("complex128"))
    du64, dB64 = paddle.grad(y64, [u64, B64], paddle.ones_like(y64))
    assert_close("complex out", out.numpy(), y64.numpy(), "float32")
    assert_close("complex du", du.numpy(), du64.numpy(), "float32")
    assert_close("complex dB", dB.numpy(), dB64.numpy(), "float32")
    assert _scan_unsupported(True, batch, dstate)("cuda") is None and _scan_unsupported(True, batch, dstate)("triton") \
        is None


def test_complex_A_cuda_routing_and_launcher_checks():
    """Which complex cases the CUDA scan takes (complex64 A and fixed B/C, real input-dependent
    pairs), and the launcher's checks of complex A's tensors (made before the library is touched)."""
    u, delta, A, B_pairs, C = _complex_inputs()
    seqlen = u.shape[2]
    with pytest.raises(BackendUnavailableError, match="'cuda' cannot run: the CUDA backend needs GPU tensors"):
        selective_scan_fn(u, delta, A, B_pairs, C, backend="cuda")
    assert _cuda_dtype_issue(u, delta, None, A, B_pairs, C) is None
    assert _cuda_dtype_issue(u, delta, None, A.astype("complex128"), B_pairs, C) == \
        "A is complex128 (the CUDA scan takes complex64 for complex A)"
    assert _cuda_dtype_issue(u, delta, None, A, paddle.real(C), B_pairs) == \
        "fixed B is float32 with complex A (the CUDA scan takes complex64)"
    assert _cuda_dtype_issue(u, delta, None, A, B_pairs.astype("float64"), C).startswith("float64 input")
    out = paddle.empty_like(u)
    with pytest.raises(ValueError, match=r"B: expected \[batch, \(groups,\) dstate, 2 \* seqlen = 18\]"):
        cuda_scan.selective_scan_fwd(u, delta, A, B_pairs[..., :seqlen], C, out)
    with pytest.raises(TypeError, match="C: expected complex64 \\(complex A, fixed\\), got float32"):
        cuda_scan.selective_scan_fwd(u, delta, A, B_pairs, paddle.real(C), out)
    with pytest.raises(TypeError, match="C: expected a real float dtype \\(real A, fixed\\), got complex64"):
        cuda_scan.selective_scan_fwd(u, delta, paddle.real(A), B_pairs[..., :seqlen], C, out)


def test_complex_A_auto_on_a_gpu_without_the_cuda_library_takes_triton(monkeypatch):
    """``auto`` on a GPU whose CUDA library is missing runs complex A on Triton, warning once with the
    reason; real A takes Triton there without a warning."""
    from paddlenlp_fused.runtime import backend as rb

    monkeypatch.setattr(rb, "_warned", set())
    monkeypatch.setattr(rb, "backend_status", lambda name, device: rb.BackendStatus(
        name != "cuda", "the CUDA library is not built" if name == "cuda" else ""))
    for op in ("selective_scan", "mamba_inner"):
        with pytest.warns(RuntimeWarning, match=r"falling back to the triton backend \(cuda: the CUDA library "
                                                r"is not built\)"):
            assert rb.resolve_backend(op, "auto", "gpu", implemented=mamba_ops.SCAN_IMPLEMENTED,
                                      unsupported=_scan_unsupported(True, 2, 3),
                                      prefer=mamba_ops.COMPLEX_A_PREFER) == "triton"
    assert rb.resolve_backend("selective_scan", "auto", "gpu", implemented=mamba_ops.SCAN_IMPLEMENTED,
                              unsupported=_scan_unsupported(False, 2, 3)) == "triton"


class _CudaStandIn:
    """kernels/cuda/selective_scan's launchers for complex A on CPU tensors, computed by the float64
    numpy recurrence, so that the ops' PyLayer glue for complex A runs here (complex64 states, last
    state and accumulators; gradients back to complex A, C and the real pairs of B). The kernels
    themselves are checked in tests/gpu."""

    states_shape = staticmethod(cuda_scan.states_shape)
    workspace_shape = staticmethod(cuda_scan.workspace_shape)

    def __init__(self):
        self.reference = selective_scan_reference

    @staticmethod
    def scan_plan(seqlen):
        return cuda_scan.ScanPlan(256, max(1, -(-seqlen // 256)))

    @staticmethod
    def _numpy(*tensors):
        return [None if t is None else t.numpy().astype(np.complex128 if t.is_complex() else np.float64)
                for t in tensors]

    @staticmethod
    def _write(target, value, accumulate=False):
        value = paddle.to_tensor(value.astype(np.complex64 if target.is_complex() else np.float32))
        paddle.assign((target + value if accumulate else value).astype(target.dtype), output=target)

    def selective_scan_fwd(self, u, delta, A, B, C, out, D, z, delta_bias, states, last_state, delta_softplus, plan):
        assert A.dtype == states.dtype == paddle.complex64
        assert last_state is None or last_state.dtype == paddle.complex64
        y, h = self.reference(*self._numpy(u, delta, A, B, C, D, z, delta_bias), softplus=delta_softplus)
        self._write(out, y)
        if last_state is not None:
            self._write(last_state, h)

    def selective_scan_bwd(self, u, delta, A, B, C, dout, states, workspace, du, ddelta, dA, dB, dC, D, z,
                           delta_bias, dD, dz, ddelta_bias, out_z, delta_softplus, plan):
        for g, t in ((dA, A), (dB, B), (dC, C)):  # complex64 exactly where the input is
            assert g.dtype == (paddle.complex64 if t.is_complex() else paddle.float32)
        y, _, grads, _ = self.reference(*self._numpy(u, delta, A, B, C, D, z, delta_bias), softplus=delta_softplus,
                                        dout=self._numpy(dout)[0])
        for target, name in ((du, "du"), (ddelta, "ddelta"), (dz, "dz")):
            if target is not None:
                self._write(target, grads[name])
        if out_z is not None:
            self._write(out_z, y)
        for target, name in ((dA, "dA"), (dB, "dB"), (dC, "dC"), (dD, "dD"), (ddelta_bias, "ddelta_bias")):
            if target is not None:
                self._write(target, grads[name], accumulate=True)


def _leaf64(t):
    """A float64 (complex128) leaf with t's values."""
    leaf = paddle.to_tensor(t.numpy().astype(np.complex128)) if t.is_complex() else paddle.to_tensor(to64(t))
    leaf.stop_gradient = False
    return leaf


def test_complex_A_through_the_cuda_pylayer(monkeypatch):
    """selective_scan_fn's PyLayer on the CUDA path with complex A (launchers stood in), against the
    reference in float64."""
    u, delta, A, B_pairs, C = _complex_inputs()
    D, z, bias = _leaf((u.shape[1],)), _leaf(u.shape), _leaf((u.shape[1],), scale=0.3)
    inputs = [u, delta, A, B_pairs, C, D, z, bias]
    inputs64 = [_leaf64(t) for t in inputs]
    ref_out, ref_last = selective_scan_ref(*inputs64, delta_softplus=True, return_last_state=True)
    monkeypatch.setitem(mamba_ops._SCAN_KERNELS, "cuda", _CudaStandIn())
    monkeypatch.setattr(mamba_ops, "resolve_backend", lambda *args, **kwargs: "cuda")
    out, last = selective_scan_fn(*inputs, delta_softplus=True, return_last_state=True, backend="cuda")
    assert last.dtype == paddle.complex64 and out.dtype == u.dtype
    assert_close("out", out.numpy(), ref_out.numpy(), "float32")
    assert_close("last_state", as_pairs(last.numpy()), as_pairs(ref_last.numpy()), "float32")
    dout = randn(out.shape)
    got = paddle.grad(out, inputs, dout)
    want = paddle.grad(ref_out, inputs64, paddle.to_tensor(to64(dout)))
    # dA, the fixed C's dC, dD and ddelta_bias sum one term per token: where they cancel they are
    # measured against their terms' magnitudes, read off the numpy float64 recurrence
    term_sums = selective_scan_reference(*[t.numpy() for t in inputs64], softplus=True, dout=to64(dout))[3]
    for name, g, w, t in zip(("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"), got, want, inputs):
        assert g.dtype == t.dtype, name
        if name in term_sums:
            assert_sum_close(name, g.numpy(), w.numpy(), term_sums[name], "float32")
        else:
            assert_close(name, as_pairs(g.numpy()), as_pairs(w.numpy()), "float32")


@pytest.mark.parametrize("backend", ("cuda", "triton"))
def test_complex_A_through_mamba_inner(monkeypatch, backend):
    """mamba_inner_fn's PyLayer with complex A on the CUDA path (scan launchers stood in) and on Triton:
    B and C projected from x_proj's rows as (re, im) pairs, their gradients folded back into those rows
    and the projection biases; against the reference composition in float64."""
    dim, dstate = 8, 3
    a = _inner_inputs(dim=dim, dstate=2 * dstate)  # x_proj [dim, r + 2 * 2n], B/C biases [2n]
    a["A"] = paddle.complex(paddle.to_tensor(-np.exp(np.random.randn(dim, dstate) * 0.5).astype(np.float32)),
                            paddle.to_tensor((np.random.randn(dim, dstate) * 2).astype(np.float32)))
    a["A"].stop_gradient = False
    names = sorted(a)
    a64 = {n: _leaf64(t) for n, t in a.items()}
    y64 = mamba_inner_ref(**a64)
    if backend == "cuda":
        monkeypatch.setitem(mamba_ops._SCAN_KERNELS, "cuda", _CudaStandIn())
        monkeypatch.setattr(mamba_ops, "resolve_backend", lambda *args, **kwargs: "cuda")
    out = mamba_inner_fn(**a, backend=backend)
    assert_close("out", out.numpy(), y64.numpy(), "float32")
    dout = randn(out.shape)
    grads = paddle.grad(out, [a[n] for n in names], dout)
    grads64 = paddle.grad(y64, [a64[n] for n in names], paddle.to_tensor(to64(dout)))
    for name, g, w in zip(names, grads, grads64):
        assert_close(f"d{name}", as_pairs(g.numpy()), as_pairs(w.numpy()), "float32")


# complex A on the Triton scan: (activation dtype, B kind, C kind, D/z/delta_bias/softplus, (batch, dim,
# seqlen, dstate), deterministic). Kinds: "pairs" input-dependent (re, im) pairs, "grouped" 3 groups of
# them, "fixed" complex [dim, dstate], "real" a real fixed one (imaginary part 0). Odd sizes; seqlen 1;
# 19 steps cross the forward's chunks (8) and the backward's (4).
COMPLEX_CASES = {
    "pairs-fp32": ("float32", "pairs", "pairs", True, (2, 5, 19, 3), False),
    "fixed-fp16": ("float16", "fixed", "fixed", False, (2, 6, 10, 2), False),
    "grouped-bf16-deterministic": ("bfloat16", "grouped", "grouped", True, (1, 6, 9, 3), True),
    "mixed-seqlen1-deterministic": ("float32", "fixed", "pairs", True, (2, 3, 1, 2), True),
    "real-fixed-C": ("bfloat16", "pairs", "real", False, (1, 4, 7, 2), False),
}


def _complex_case(case, rng):
    """Paddle inputs of a COMPLEX_CASES case (leaves) and their float64 / complex128 numpy values."""
    dtype, B_kind, C_kind, options, (batch, dim, seqlen, dstate), _ = case

    def bc(kind):
        if kind == "fixed":
            return rng.standard_normal((dim, dstate)) + 1j * rng.standard_normal((dim, dstate)), "complex64"
        if kind == "real":
            return rng.standard_normal((dim, dstate)), "float32"
        return rng.standard_normal((batch, 3, dstate, 2 * seqlen) if kind == "grouped" else
                                   (batch, dstate, 2 * seqlen)), dtype
    values = dict(u=(rng.standard_normal((batch, dim, seqlen)), dtype),
                  delta=(rng.standard_normal((batch, dim, seqlen)) * 0.5 - (1.0 if options else -0.5), dtype),
                  # decaying, oscillating up to a few radians a step
                  A=(-np.exp(rng.standard_normal((dim, dstate)) * 0.5) + 2j * rng.standard_normal((dim, dstate)),
                     "complex64"),
                  B=bc(B_kind), C=bc(C_kind))
    if options:
        values.update(D=(rng.standard_normal(dim), "float32"), z=(rng.standard_normal((batch, dim, seqlen)), dtype),
                      delta_bias=(rng.standard_normal(dim) * 0.3, "float32"))
    leaves, exact = {}, {}
    for name, (x, t_dtype) in values.items():
        t = paddle.to_tensor(x.astype(np.complex64 if t_dtype == "complex64" else np.float32)).astype(t_dtype)
        t.stop_gradient = False
        leaves[name], exact[name] = t, _np64(t)
    return leaves, exact


def _np64(t):
    """float64 (complex128) numpy values of a tensor of any dtype."""
    return t.numpy().astype(np.complex128) if t.is_complex() else to64(t)


def _check_complex_grads(names, got, want, term_sums, dtype):
    """Gradients against float64 ones: those summing a term per token (dA, fixed dB/dC, dD, ddelta_bias)
    by ``assert_sum_close``, the rest by their (re, im) pairs."""
    for name, g, w in zip(names, got, want):
        if name in term_sums:
            assert_sum_close(name, g, w, term_sums[name], dtype)
        else:
            assert_close(name, as_pairs(g), as_pairs(w), dtype)


@pytest.mark.parametrize("name", sorted(COMPLEX_CASES))
def test_complex_A_triton_scan_matches_float64_and_the_reference(name):
    """selective_scan_fn on Triton with complex A against the numpy float64 recurrence with its
    hand-written adjoint (testing/scan_reference.py), and against the reference backend's autograd in
    float64 (Paddle's convention for complex gradients, dL/dre + i dL/dim); two cases through the
    deterministic backward (the op's partials workspace in pairs)."""
    case = COMPLEX_CASES[name]
    dtype, options, deterministic = case[0], case[3], case[5]
    leaves, exact = _complex_case(case, np.random.default_rng(np.random.randint(2**31)))
    names = list(leaves)
    out, last = selective_scan_fn(**leaves, delta_softplus=options, return_last_state=True, backend="triton",
                                  deterministic=deterministic)
    assert out.dtype == leaves["u"].dtype and last.dtype == paddle.complex64 and last.stop_gradient
    dout = randn(out.shape, dtype)
    got = [_np64(g) for g in paddle.grad(out, list(leaves.values()), dout)]
    for g, t in zip(got, leaves.values()):
        assert g.shape == tuple(t.shape)
    grad_names = ["d" + n if n in "ABCD" else {"u": "du", "delta": "ddelta", "z": "dz"}.get(n, "d" + n) for n in names]

    ref_out, ref_last, ref_grads, term_sums = selective_scan_reference(**exact, softplus=options, dout=to64(dout))
    assert_close("out", to64(out), ref_out, dtype)
    assert_close("last_state", as_pairs(_np64(last)), as_pairs(ref_last), dtype)
    # a real fixed C's gradient is the real part of the complex one
    want = [ref_grads[g].real if not np.iscomplexobj(exact[n]) else ref_grads[g] for g, n in zip(grad_names, names)]
    _check_complex_grads(grad_names, got, want, term_sums, dtype)

    leaves64 = {n: _leaf64(t) for n, t in leaves.items()}
    out64 = selective_scan_ref(**leaves64, delta_softplus=options)
    assert_close("out vs the reference", to64(out), out64.numpy(), dtype)
    # (seqlen 1: A, whose first decay multiplies the zero initial state, is not in the reference's graph)
    want = [np.zeros(t.shape, _np64(t).dtype) if g is None else _np64(g) for g, t in zip(
        paddle.grad(out64, list(leaves64.values()), paddle.to_tensor(to64(dout)), allow_unused=True),
        leaves64.values())]
    _check_complex_grads(grad_names, got, want, term_sums, dtype)


def _complex_launch(u, delta, A, B, C, D, z, bias, dout, plan, nan, partials=False, block_d=None):
    """The Triton launchers on (re, im) pair tensors, every output poisoned: (out, last, out_z, grads)."""
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    out, out_z, du, ddelta, dz = (nan(u.shape) for _ in range(5))
    last = nan((batch, dim, dstate, 2))
    states = nan(scan_kernels.states_shape(batch, dim, dstate, plan, True))
    work = nan(scan_kernels.workspace_shape(batch, dim, dstate, plan, True))
    scan_kernels.selective_scan_fwd(*triton_args(u, delta, A, B, C, out, D, z, bias, states, last),
                                    delta_softplus=True, plan=plan, block_d=block_d)
    acc = [paddle.zeros(list(t.shape), dtype="float32") for t in (A, B, C, D, bias)]
    options = dict(plan=plan, block_d=block_d)
    if partials:
        layout = scan_kernels.bwd_partials_layout(*triton_args(u, A, B, C, D, bias), **options)
        options["partials"] = triton_args(nan((layout["numel"],)))[0]
    scan_kernels.selective_scan_bwd(*triton_args(u, delta, A, B, C, dout, states, work, du, ddelta, acc[0], acc[1],
                                                 acc[2], D, z, bias, acc[3], dz, acc[4], out_z),
                                    delta_softplus=True, **options)
    return out, last, out_z, dict(du=du, ddelta=ddelta, dA=acc[0], dB=acc[1], dC=acc[2], dD=acc[3], dz=dz,
                                  ddelta_bias=acc[4])


def test_complex_A_triton_launchers_strided_chunked_deterministic():
    """The launchers directly with complex A: chunks of 4 in segments of 2 (4 segments, the last
    partial), every output poisoned; u, delta, z, dout as [b, l, d] memory viewed [b, d, l], A's pairs
    from a transposed complex tensor, B's from [b, l, n, 2] memory viewed [b, n, l, 2] (fixed complex C).
    Equal to float64; the deterministic backward (blocks of 2 dims, partials poisoned) equal to it and
    bit-identical twice."""
    batch, dim, seqlen, dstate = 2, 4, 15, 3
    rng = np.random.default_rng(np.random.randint(2**31))
    def strided(x):
        return paddle.to_tensor(np.ascontiguousarray(x.transpose(0, 2, 1)).astype(np.float32)).transpose([0, 2, 1])
    u, z, dout = (strided(rng.standard_normal((batch, dim, seqlen))) for _ in range(3))
    delta = strided(rng.standard_normal((batch, dim, seqlen)) * 0.5 - 1.0)
    A64 = -np.exp(rng.standard_normal((dim, dstate)) * 0.5) + 2j * rng.standard_normal((dim, dstate))
    A = paddle.as_real(paddle.to_tensor(np.ascontiguousarray(A64.T).astype(np.complex64)).transpose([1, 0]))
    B64 = rng.standard_normal((batch, dstate, 2 * seqlen))
    B = paddle.to_tensor(np.ascontiguousarray(B64.reshape(batch, dstate, seqlen, 2).transpose(0, 2, 1, 3))
                         .astype(np.float32)).transpose([0, 2, 1, 3])
    C64 = rng.standard_normal((dim, dstate)) + 1j * rng.standard_normal((dim, dstate))
    C = paddle.as_real(paddle.to_tensor(C64.astype(np.complex64)))
    D, bias = paddle.to_tensor(rng.standard_normal(dim).astype(np.float32)), \
        paddle.to_tensor((rng.standard_normal(dim) * 0.3).astype(np.float32))
    assert not (u.is_contiguous() or A.is_contiguous() or B.is_contiguous())
    plan = scan_kernels.scan_plan(seqlen, chunk=4, seg_chunks=2)
    assert (plan.n_chunks, plan.n_segments) == (4, 2)
    nan = lambda shape: paddle.full(list(shape), float("nan"), dtype="float32")  # noqa: E731
    exact = dict(u=to64(u), delta=to64(delta), A=A64.astype(np.complex64).astype(np.complex128),
                 B=B64.astype(np.float32).astype(np.float64), C=C64.astype(np.complex64).astype(np.complex128),
                 D=to64(D), z=to64(z), delta_bias=to64(bias))
    ref_out, ref_last, ref_grads, term_sums = selective_scan_reference(**exact, softplus=True, dout=to64(dout))
    runs = [_complex_launch(u, delta, A, B, C, D, z, bias, dout, plan, nan)] + \
        [_complex_launch(u, delta, A, B, C, D, z, bias, dout, plan, nan, partials=True, block_d=2) for _ in range(2)]
    for out, last, out_z, grads in runs[:2]:
        assert_close("out", out.numpy(), ref_out, "float32")
        assert_close("out_z", out_z.numpy(), ref_out, "float32")
        assert_close("last_state", last.numpy(), as_pairs(ref_last), "float32")
        names = list(grads)
        got = [g.numpy() for g in grads.values()]
        got = [g[..., 0] + 1j * g[..., 1] if np.iscomplexobj(ref_grads[n]) else g.reshape(ref_grads[n].shape)
               for n, g in zip(names, got)]
        _check_complex_grads(names, got, [ref_grads[n] for n in names], term_sums, "float32")
    for name in runs[1][3]:
        assert np.array_equal(runs[1][3][name].numpy(), runs[2][3][name].numpy()), name


def test_complex_A_bad_inputs():
    """What complex A cannot take is named, the same on every backend (the ops check before choosing
    one); the Triton launchers name a wrong pair layout."""
    u, delta, A, B_pairs, C = (t.detach() for t in _complex_inputs(batch=1, dim=4, dstate=3, seqlen=5))
    for backend in ("triton", "reference", "cuda"):
        with pytest.raises(TypeError, match=r"B: expected dtype in .* \(input-dependent \(real \(re, im\) pairs\)\), "
                                            r"got complex64"):
            selective_scan_fn(u, delta, A, paddle.complex(B_pairs, B_pairs), C, backend=backend)
        with pytest.raises(TypeError, match=r"C: expected dtype in .* \(real A\), got complex64"):
            selective_scan_fn(u, delta, paddle.real(A), B_pairs[..., :5], C, backend=backend)
        with pytest.raises(ValueError, match=r"B: expected .*seqlen=10"):
            selective_scan_fn(u, delta, A, B_pairs[..., :5], C, backend=backend)
        with pytest.raises(TypeError, match="C: expected dtype in .*got int32"):
            selective_scan_fn(u, delta, A, B_pairs, paddle.ones([4, 3], dtype="int32"), backend=backend)
    A_pairs, C_pairs, B4 = paddle.as_real(A), paddle.as_real(C), B_pairs.reshape([1, 3, 5, 2])
    out = paddle.empty_like(u)
    with pytest.raises(ValueError, match=r"A: expected \[dim=4, dstate\] \(real\) or \[dim=4, dstate, 2\]"):
        scan_kernels.selective_scan_fwd(*triton_args(u, delta, paddle.concat([A_pairs, A_pairs], -1), B4, C_pairs,
                                                     out))
    with pytest.raises(ValueError, match=r"B: expected \(re, im\) pairs .* with the last axis contiguous"):
        scan_kernels.selective_scan_fwd(*triton_args(u, delta, A_pairs, B4.transpose([0, 1, 3, 2]).contiguous()
                                                     .transpose([0, 1, 3, 2]), C_pairs, out))
    with pytest.raises(ValueError, match=r"C: expected shape \(4, 3, 2\)"):
        scan_kernels.selective_scan_fwd(*triton_args(u, delta, A_pairs, B4, C_pairs[:3], out))
    with pytest.raises(ValueError, match=r"last_state: expected shape \(1, 4, 3, 2\)"):
        scan_kernels.selective_scan_fwd(*triton_args(u, delta, A_pairs, B4, C_pairs, out),
                                        last_state=triton_args(paddle.empty([1, 4, 3]))[0])


def test_complex128_A_on_triton_computes_as_the_reference():
    """complex128 A (and fixed C) with float32 activations: Triton computes in complex64, as the
    reference does (its compute dtype follows the activations), gradients in complex128."""
    u, delta, A, B_pairs, C = (t.detach() for t in _complex_inputs(batch=1, dim=3, dstate=2, seqlen=6))
    A, C = A.astype("complex128"), C.astype("complex128")
    A.stop_gradient = C.stop_gradient = False
    out = selective_scan_fn(u, delta, A, B_pairs, C, backend="triton")
    ref = selective_scan_ref(u, delta, A, B_pairs, C)
    assert_close("out", out.numpy(), ref.numpy().astype(np.float64), "float32")
    dout = randn(out.shape)
    for name, g, w in zip("AC", paddle.grad(out, [A, C], dout), paddle.grad(ref, [A, C], dout)):
        assert g.dtype == paddle.complex128, name
        assert_close("d" + name, as_pairs(g.numpy()), as_pairs(w.numpy()), "float32")


def test_scan_cuda_backend_on_cpu_and_its_limits():
    """The CUDA scan (csrc/selective_scan.cu, verified in tests/gpu) refuses CPU tensors by name, says
    which cases it cannot take, and its launchers check shapes before touching the library."""
    ins = [t.detach() for t in _scan_inputs(SCAN_CASES["variable"])]
    with pytest.raises(BackendUnavailableError, match="'cuda' cannot run: the CUDA backend needs GPU tensors"):
        selective_scan_fn(*ins, delta_softplus=True, backend="cuda")
    with pytest.raises(BackendUnavailableError, match="'cuda' cannot run: the CUDA backend needs GPU tensors"):
        mamba_inner_fn(**_inner_inputs(), backend="cuda")
    why = _scan_unsupported(False, 2, 6)
    assert why("cuda") is None and why("triton") is None
    assert _scan_unsupported(False, 2, 512)("cuda") == "dstate 512 > 256"
    assert _scan_unsupported(False, 70000, 16)("cuda") == "batch 70000 > 65535"
    assert _scan_unsupported(False, 70000, 512)("triton") is None
    u, delta, A, B, C = ins[:5]
    assert _cuda_dtype_issue(u, delta, None, A, B, C) is None
    assert _cuda_dtype_issue(u, delta.astype("float16"), None).startswith("delta is float16, u is float32")
    assert _cuda_dtype_issue(u, delta, None, A.astype("float64")).startswith("float64 input")
    assert _scan_unsupported(False, 2, 6, "why")("cuda") == "why"
    with pytest.raises(ValueError, match="B: expected"):
        cuda_scan.selective_scan_fwd(u, delta, A, B[:, :, :5], C, paddle.empty_like(u))
    with pytest.raises(ValueError, match="A: expected"):
        cuda_scan.selective_scan_fwd(u, delta, A[:3], B, C, paddle.empty_like(u))
    with pytest.raises(TypeError, match="delta: expected u's dtype"):
        cuda_scan.selective_scan_fwd(u, delta.astype("float16"), A, B, C, paddle.empty_like(u))


# ----------------------------------------------------------------------------------------------
# deterministic backward (issue #18)


@pytest.mark.parametrize("B_kind,C_kind", [("grouped", "grouped"), ("fixed", "variable")])
def test_scan_deterministic_backward_launcher(B_kind, C_kind):
    """The partials path: several programs add into every accumulated gradient (2 batch rows; 4
    blocks of 2 dims, 2 in each group of grouped B), partials poisoned with NaN. Equal to float64;
    two runs bit-identical, the second accumulated onto ones (so exactly the first plus 1 in float32)."""
    case = dict(dtype="float32", B=B_kind, C=C_kind, D=True, z=True, bias=True, softplus=True)
    u, delta, A, B, C, D, z, bias = (t.detach() for t in _scan_inputs(case, dim=8, seqlen=11, groups=2))
    batch, dim, seqlen = u.shape
    dstate = A.shape[1]
    plan = scan_kernels.scan_plan(seqlen, chunk=4, seg_chunks=2)
    tiles = dict(plan=plan, block_d=2, dim_regs=1)
    layout = scan_kernels.bwd_partials_layout(*triton_args(u, A, B, C, D, bias), **tiles)
    assert layout["dA"][1:] == (batch, dim * dstate, 1)
    if B_kind == "grouped":  # [batch * groups, 2 blocks a group, dstate * seqlen]
        assert layout["dB"][1:] == (2, dstate * seqlen, batch * 2)
    states = paddle.empty(list(scan_kernels.states_shape(batch, dim, dstate, plan)))
    scan_kernels.selective_scan_fwd(*triton_args(u, delta, A, B, C, paddle.empty_like(u), D, z, bias, states),
                                    delta_softplus=True, plan=plan)
    dout = randn(u.shape)
    runs = []
    for start in (0.0, 1.0):
        du, ddelta, dz = (paddle.full(u.shape, float("nan")) for _ in range(3))
        work = paddle.full(list(scan_kernels.workspace_shape(batch, dim, dstate, plan)), float("nan"))
        acc = [paddle.full(list(t.shape), start) for t in (A, B, C, D, bias)]
        partials = paddle.full([layout["numel"]], float("nan"))
        scan_kernels.selective_scan_bwd(*triton_args(u, delta, A, B, C, dout, states, work, du, ddelta, acc[0],
                                                     acc[1], acc[2], D, z, bias, acc[3], dz, acc[4]),
                                        delta_softplus=True, partials=triton_args(partials)[0], **tiles)
        runs.append([t.numpy() for t in [du, ddelta, dz] + acc])
    ins64 = [as_leaf64(t) for t in (u, delta, A, B, C, D, z, bias)]
    y64, _ = scan64(*ins64, softplus=True)
    grads64 = paddle.grad(y64, ins64, paddle.to_tensor(to64(dout)))
    names = ["du", "ddelta", "dz", "dA", "dB", "dC", "dD", "ddelta_bias"]
    order = [0, 1, 6, 2, 3, 4, 5, 7]  # grads64 follows (u, delta, A, B, C, D, z, bias)
    for name, got, k in zip(names, runs[0], order):
        assert_close(name, got.astype(np.float64), grads64[k].numpy(), "float32")
    for name, first, second in zip(names, *runs):
        want = first if name in ("du", "ddelta", "dz") else first + np.float32(1.0)
        assert np.array_equal(second, want), name
    with pytest.raises(ValueError, match="partials: expected shape"):
        scan_kernels.selective_scan_bwd(*triton_args(u, delta, A, B, C, dout, states, work, du, ddelta, acc[0],
                                                     acc[1], acc[2], D, z, bias, acc[3], dz, acc[4]),
                                        delta_softplus=True, partials=triton_args(paddle.zeros([3]))[0], **tiles)


def test_scan_deterministic_option_flag_and_routing(monkeypatch):
    """deterministic=True, and None under FLAGS_cudnn_deterministic, hand the Triton scan backward a
    partials workspace (and mamba_inner_fn's conv backward its workspace); False, the unset flag and a
    call that cannot be differentiated do not. Gradients as float64's; anything but None or a bool is
    a TypeError; the CUDA scan is routed around (an explicit ``cuda`` raises)."""
    from paddlenlp_fused.runtime import backend as rb

    seen = []
    real_scan, real_conv = scan_kernels.selective_scan_bwd, conv_kernels.causal_conv1d_bwd
    monkeypatch.setattr(scan_kernels, "selective_scan_bwd",
                        lambda *a, **k: (seen.append(("scan", "partials" in k)), real_scan(*a, **k))[1])
    monkeypatch.setattr(conv_kernels, "causal_conv1d_bwd",
                        lambda *a, **k: (seen.append(("conv", k.get("workspace") is not None)), real_conv(*a, **k))[1])
    ins = _scan_inputs(SCAN_CASES["variable"], seqlen=9)
    grads = {}
    for deterministic, env in deterministic_settings(monkeypatch):
        out = selective_scan_fn(*ins, delta_softplus=True, backend="triton", deterministic=deterministic)
        dout = randn(out.shape)
        grads[(deterministic, env)] = (dout, _grads(out, ins, dout))
    assert seen == [("scan", False), ("scan", True), ("scan", False), ("scan", True)]
    dout, got = grads[(True, None)]
    ins64 = [as_leaf64(t) for t in ins]
    y64, _ = scan64(*ins64, softplus=True)
    _check_all(["du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"], got,
               _grads(y64, ins64, paddle.to_tensor(to64(dout))), "float32")

    seen.clear()
    a = _inner_inputs(seqlen=7)
    out = mamba_inner_fn(**a, backend="triton", deterministic=True)
    paddle.grad(out, [a[n] for n in sorted(a)], randn(out.shape))
    assert sorted(seen) == [("conv", True), ("scan", True)]
    with paddle.no_grad():
        assert not mamba_ops._deterministic_backward(True, ins[0])
    assert not mamba_ops._deterministic_backward(True, ins[0].detach())
    assert mamba_ops._deterministic_backward(True, ins[0])
    for bad in (1, "yes"):
        with pytest.raises(TypeError, match="deterministic: expected None, True or False"):
            selective_scan_fn(*ins, backend="reference", deterministic=bad)
    with pytest.raises(TypeError, match="deterministic"):
        mamba_inner_fn(**a, backend="triton", deterministic=0)

    why = _scan_unsupported(False, 2, 6, None, True)
    assert why("cuda").startswith("deterministic (the CUDA backward adds dA, dB, dC") and why("triton") is None
    monkeypatch.setattr(rb, "_warned", set())
    monkeypatch.setattr(rb, "backend_status", lambda name, device: rb.BackendStatus(True, ""))
    with pytest.warns(RuntimeWarning, match=r"falling back to the triton backend \(cuda: deterministic"):
        assert rb.resolve_backend("selective_scan", "auto", "gpu", implemented=mamba_ops.SCAN_IMPLEMENTED,
                                  unsupported=why, prefer=("cuda", "triton")) == "triton"
    with pytest.raises(BackendUnavailableError, match="'cuda' does not support this call: deterministic"):
        rb.resolve_backend("selective_scan", "cuda", "gpu", implemented=mamba_ops.SCAN_IMPLEMENTED, unsupported=why)
    monkeypatch.setattr(rb, "_warned", set())
    with pytest.warns(RuntimeWarning, match=r"falling back to the triton backend \(cuda: deterministic"):
        assert rb.resolve_backend("selective_scan", "auto", "gpu", implemented=mamba_ops.SCAN_IMPLEMENTED,
                                  unsupported=_scan_unsupported(True, 2, 3, None, True),
                                  prefer=mamba_ops.COMPLEX_A_PREFER) == "triton"


# ----------------------------------------------------------------------------------------------
# causal conv1d

CONV_CASES = {
    "w4-silu-init": dict(dtype="float32", width=4, activation="silu", bias=True, init=True),
    "w3-none": dict(dtype="float16", width=3, activation=None, bias=False, init=False),
    "w5-bf16": dict(dtype="bfloat16", width=5, activation="swish", bias=True, init=True),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", sorted(CONV_CASES))
def test_causal_conv1d_matches_float64(name, backend):
    case = CONV_CASES[name]
    batch, dim, seqlen, width, dtype = 2, 6, 19, case["width"], case["dtype"]
    x = _leaf((batch, dim, seqlen), dtype)
    weight = _leaf((dim, width), dtype, scale=0.5)
    bias = _leaf((dim,), dtype) if case["bias"] else None
    init = _leaf((batch, dim, width - 1), dtype) if case["init"] else None
    out, final = causal_conv1d_fn(x, weight, bias, initial_states=init, return_final_states=True,
                                  activation=case["activation"], backend=backend)
    dout, dfinal = randn(out.shape, dtype), randn(final.shape, dtype)
    ins = [x, weight, bias, init]
    grads = _grads([out, final], ins, [dout, dfinal])

    ins64 = [None if t is None else as_leaf64(t) for t in ins]
    act = "silu" if case["activation"] else None
    y64 = conv64(*ins64, activation=act)
    history64 = paddle.concat([ins64[3] if init is not None else paddle.zeros([batch, dim, width - 1], "float64"),
                               ins64[0]], axis=-1)
    final64 = history64[:, :, -(width - 1):]
    grads64 = _grads([y64, final64], ins64, [paddle.to_tensor(to64(dout)), paddle.to_tensor(to64(dfinal))])
    assert_close("out", to64(out), y64.numpy(), dtype)
    np.testing.assert_array_equal(to64(final), final64.numpy())
    names = [n for n, t in zip(["dx", "dweight", "dbias", "dinitial_states"], ins) if t is not None]
    _check_all(names, grads, grads64, dtype)


def test_conv_launchers_channel_last_many_segments():
    """Launchers on a channel-last x (dim contiguous) in segments of 8 positions, with seq_idx and
    initial states, outputs poisoned; against the float64 conv of each sequence."""
    batch, dim, seqlen, width = 2, 5, 29, 4
    x = randn((batch, seqlen, dim)).transpose([0, 2, 1])  # strides (l*d, 1, d)
    assert x.strides[1] == 1
    weight, bias, init = randn((dim, width)), randn((dim,)), randn((batch, dim, width - 1))
    seq_idx = paddle.to_tensor(np.repeat([[0] * 11 + [1] * 5 + [2] * 13], batch, axis=0).astype(np.int32))
    out = paddle.full([batch, dim, seqlen], float("nan"))
    conv_kernels.causal_conv1d_fwd(*triton_args(x, weight, out, bias, seq_idx, init), activation="silu", segment=8)
    dout = randn((batch, dim, seqlen))
    dx, dinit = paddle.full([batch, dim, seqlen], float("nan")), paddle.full([batch, dim, width - 1], float("nan"))
    dw, db = paddle.zeros([dim, width]), paddle.zeros([dim])
    conv_kernels.causal_conv1d_bwd(*triton_args(x, weight, dout, dx, dw, bias, db, seq_idx, init, dinit),
                                   activation="silu", segment=8)
    ins64 = [as_leaf64(t) for t in (x, weight, bias, init)]
    pieces, start = [], 0
    for length in (11, 5, 13):  # each sequence on its own; the first continues the initial states
        piece = ins64[0][:, :, start:start + length]
        pieces.append(conv64(piece, ins64[1], ins64[2], ins64[3] if start == 0 else None, "silu"))
        start += length
    y64 = paddle.concat(pieces, axis=-1)
    grads64 = paddle.grad(y64, ins64, paddle.to_tensor(to64(dout)))
    assert_close("out", out.numpy(), y64.numpy(), "float32")
    _check_all(["dx", "dweight", "dbias", "dinitial_states"], [dx, dw, db, dinit], grads64, "float32")


@pytest.mark.parametrize("backend", BACKENDS)
def test_packed_batch_with_seq_idx_equals_separate_sequences(backend):
    dim, width, lengths = 6, 4, (7, 1, 12)
    xs = [_leaf((1, dim, n)) for n in lengths]
    weight, bias = _leaf((dim, width)), _leaf((dim,))
    packed = paddle.concat(xs, axis=-1)
    seq_idx = paddle.to_tensor(np.concatenate([[i] * n for i, n in enumerate(lengths)])[None].astype(np.int64))
    out = causal_conv1d_fn(packed, weight, bias, seq_idx=seq_idx, activation="silu", backend=backend)
    separate = paddle.concat([causal_conv1d_fn(x, weight, bias, activation="silu", backend=backend) for x in xs],
                             axis=-1)
    np.testing.assert_allclose(out.numpy(), separate.numpy(), rtol=1e-5, atol=1e-6)
    dout = randn(out.shape)
    g_packed = paddle.grad(out, xs + [weight, bias], dout)
    g_separate = paddle.grad(separate, xs + [weight, bias], dout)
    for a, b in zip(g_packed, g_separate):
        np.testing.assert_allclose(a.numpy(), b.numpy(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# decoding steps


@pytest.mark.parametrize("backend", BACKENDS)
def test_causal_conv1d_update_shifted_and_circular(backend):
    batch, dim, width = 2, 5, 4
    weight, bias = randn((dim, width)), randn((dim,))
    for state_len, steps, ring in ((4, None, False), (6, 3, False), (5, None, True), (5, 7, True)):
        history = np.random.randn(batch, dim, 12).astype(np.float32)  # all inputs so far
        seen = np.array([12, 9])  # tokens seen per row (the ring's write position)
        state = np.zeros((batch, dim, state_len), np.float32)
        for b in range(batch):
            for t in range(seen[b]):
                slot = t % state_len if ring else state_len - seen[b] + t
                if slot >= 0:
                    state[b, :, slot] = history[b, :, t]
        x = randn((batch, dim) if steps is None else (batch, dim, steps))
        conv_state = paddle.to_tensor(state)
        out = causal_conv1d_update(x, conv_state, weight, bias, "silu",
                                   cache_seqlens=paddle.to_tensor(seen.astype(np.int32)) if ring else None,
                                   backend=backend)
        x3 = to64(x)[..., None] if steps is None else to64(x)
        n_new = x3.shape[-1]
        w64, b64 = to64(weight), to64(bias)
        for b in range(batch):
            seq = np.concatenate([history[b, :, :seen[b]], x3[b]], axis=-1)
            full = conv64(paddle.to_tensor(seq[None]), paddle.to_tensor(w64), paddle.to_tensor(b64),
                          activation="silu").numpy()[0]
            want = full[:, -n_new:]
            got = out.numpy()[b] if steps is not None else out.numpy()[b][:, None]
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
            total = seen[b] + n_new
            for slot in range(state_len):  # the state holds the last inputs, where the layout puts them
                t = (total - 1) - ((total - 1 - slot) % state_len) if ring else total - state_len + slot
                np.testing.assert_allclose(conv_state.numpy()[b, :, slot], seq[:, t], rtol=1e-6)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_state_update_matches_recurrence(backend):
    batch, dim, dstate, groups = 2, 6, 3, 2
    state0 = randn((batch, dim, dstate))
    x, dt, z = randn((batch, dim)), randn((batch, dim), scale=0.5), randn((batch, dim))
    A = paddle.to_tensor(-np.exp(np.random.randn(dim, dstate)).astype(np.float32))
    B, C = randn((batch, groups, dstate)), randn((batch, groups, dstate))
    D, dt_bias = randn((dim,)), randn((dim,))
    state = state0.clone()
    out = selective_state_update(state, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True, backend=backend)
    # one step of scan64 from the given state: run it on [state; token] with u, dt chosen so that
    # the first step reproduces the state exactly is awkward; write the step out instead
    dt64 = np.log1p(np.exp(to64(dt) + to64(dt_bias)))
    per_dim = lambda M: np.repeat(to64(M), dim // groups, axis=1)  # noqa: E731
    new = to64(state0) * np.exp(dt64[..., None] * to64(A)) + (dt64 * to64(x))[..., None] * per_dim(B)
    y = (new * per_dim(C)).sum(-1) + to64(D) * to64(x)
    y = y * to64(z) / (1 + np.exp(-to64(z)))
    assert_close("state", state.numpy(), new, "float32")
    assert_close("out", out.numpy(), y, "float32")


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
def test_selective_state_update_state_batch_indices(backend, dtype):
    """state_batch_indices (mamba_ssm's continuous batching): row b updates slot idx[b] of a larger
    cache, in any order; -1 rows (padding) output 0 and touch no slot; other slots bit-unchanged;
    odd dim and dstate; against float64 (16-bit: 2x the bound of one rounding, as the step rounds
    state and out once)."""
    batch, dim, dstate, slots = 4, 5, 3, 6
    idx = np.array([4, -1, 0, 2])
    cache = randn((slots, dim, dstate), dtype)
    before = to64(cache)
    x, dt, z = randn((batch, dim), dtype), randn((batch, dim), dtype, 0.5), randn((batch, dim), dtype)
    A = paddle.to_tensor(-np.exp(np.random.randn(dim, dstate)).astype(np.float32))
    B, C = randn((batch, dstate), dtype), randn((batch, dstate), dtype)
    D, dt_bias = randn((dim,)), randn((dim,))
    out = selective_state_update(cache, x, dt, A, B, C, D, z, dt_bias, dt_softplus=True,
                                 state_batch_indices=paddle.to_tensor(idx.astype(np.int32)), backend=backend)
    live = idx >= 0
    dt64 = np.log1p(np.exp(to64(dt) + to64(dt_bias)))[live]
    new = before[idx[live]] * np.exp(dt64[..., None] * to64(A)) + (dt64 * to64(x)[live])[..., None] * \
        to64(B)[live][:, None, :]
    y = (new * to64(C)[live][:, None, :]).sum(-1) + to64(D) * to64(x)[live]
    y = y * to64(z)[live] / (1 + np.exp(-to64(z)[live]))
    got, after = to64(out), to64(cache)
    assert (got[~live] == 0).all()
    untouched = [s for s in range(slots) if s not in idx]
    np.testing.assert_array_equal(after[untouched], before[untouched])
    baseline = None if dtype == "float32" else 2 * {"float16": 2.0 ** -11, "bfloat16": 2.0 ** -8}[dtype]
    assert_close("state", after[idx[live]], new, dtype, baseline)
    assert_close("out", got[live], y, dtype, baseline)


@pytest.mark.parametrize("backend", BACKENDS)
def test_selective_state_update_state_batch_indices_bad_input(backend):
    cache, x, A = randn((3, 4, 2)), randn((2, 4)), randn((4, 2))
    B = randn((2, 2))
    with pytest.raises(ValueError, match="state_batch_indices: expected entries < 3"):
        selective_state_update(cache, x, x, A, B, B, state_batch_indices=paddle.to_tensor([0, 3]), backend=backend)
    with pytest.raises(TypeError, match="state_batch_indices: expected dtype"):
        selective_state_update(cache, x, x, A, B, B, state_batch_indices=paddle.to_tensor([0.0, 1.0]),
                               backend=backend)
    with pytest.raises(ValueError, match="state_batch_indices: expected shape"):
        selective_state_update(cache, x, x, A, B, B, state_batch_indices=paddle.to_tensor([0, 1, 2]),
                               backend=backend)
    with pytest.raises(ValueError, match="x: expected shape"):
        selective_state_update(cache, randn((2, 5)), x, A, B, B, state_batch_indices=paddle.to_tensor([0, 1]),
                               backend=backend)


# ----------------------------------------------------------------------------------------------
# mamba_inner_fn and the layer


def _inner_inputs(batch=2, dim=8, seqlen=13, dstate=4, rank=2, d_model=5, width=4):
    return dict(xz=_leaf((batch, 2 * dim, seqlen)), conv1d_weight=_leaf((dim, 1, width), scale=0.5),
                conv1d_bias=_leaf((dim,)), x_proj_weight=_leaf((dim, rank + 2 * dstate), scale=0.4),
                delta_proj_weight=_leaf((rank, dim), scale=0.4), out_proj_weight=_leaf((dim, d_model), scale=0.4),
                out_proj_bias=_leaf((d_model,)),
                A=paddle.to_tensor(-np.exp(np.random.randn(dim, dstate) * 0.5).astype(np.float32), stop_gradient=False),
                D=_leaf((dim,)), delta_bias=_leaf((dim,), scale=0.3), B_proj_bias=_leaf((dstate,), scale=0.2),
                C_proj_bias=_leaf((dstate,), scale=0.2))


def _rms64(t, w, eps, axis):
    """RMSNorm over ``axis`` in float64 (the weight along it)."""
    shape = [1] * t.ndim
    shape[axis] = t.shape[axis]
    return t / paddle.sqrt((t * t).mean(axis=axis, keepdim=True) + eps) * w.reshape(shape)


def _inner64(a):
    """The composition in float64: conv, projections (B after dt's columns, C in the last ones, each
    unless given), the optional B/C/dt RMSNorms, sequential scan, output projection."""
    batch, two_dim, seqlen = a["xz"].shape
    dim, rank, dstate = two_dim // 2, a["delta_proj_weight"].shape[0], a["A"].shape[1]
    eps = a.get("b_c_dt_rms_eps", 1e-6)
    x, z = a["xz"][:, :dim], a["xz"][:, dim:]
    xc = conv64(x, a["conv1d_weight"].reshape([dim, -1]), a["conv1d_bias"], activation="silu")
    x_dbl = paddle.matmul(xc.transpose([0, 2, 1]), a["x_proj_weight"])  # [b, l, r (+ n) (+ n)]
    delta = paddle.matmul(x_dbl[..., :rank], a["delta_proj_weight"]).transpose([0, 2, 1])
    if a.get("dt_rms_weight") is not None:
        delta = _rms64(delta, a["dt_rms_weight"], eps, 1)
    B, C = a.get("B"), a.get("C")
    if B is None:
        B = (x_dbl[..., rank:rank + dstate] + a["B_proj_bias"]).transpose([0, 2, 1])
    if C is None:
        C = (x_dbl[..., x_dbl.shape[-1] - dstate:] + a["C_proj_bias"]).transpose([0, 2, 1])
    if a.get("b_rms_weight") is not None:
        B = _rms64(B, a["b_rms_weight"], eps, B.ndim - 2)
    if a.get("c_rms_weight") is not None:
        C = _rms64(C, a["c_rms_weight"], eps, C.ndim - 2)
    y, _ = scan64(xc, delta, a["A"], B, C, a["D"], z, a["delta_bias"], softplus=True)
    return paddle.matmul(y.transpose([0, 2, 1]), a["out_proj_weight"]) + a["out_proj_bias"]


@pytest.mark.parametrize("checkpoint_lvl", [0, 1])
def test_mamba_inner_fn_equals_composition(checkpoint_lvl):
    a = _inner_inputs()
    out = mamba_inner_fn(**a, checkpoint_lvl=checkpoint_lvl, backend="triton")
    dout = randn(out.shape)
    names = sorted(a)
    grads = paddle.grad(out, [a[n] for n in names], dout)
    a64 = {n: as_leaf64(t) for n, t in a.items()}
    y64 = _inner64(a64)
    grads64 = paddle.grad(y64, [a64[n] for n in names], paddle.to_tensor(to64(dout)))
    assert_close("out", out.numpy(), y64.numpy(), "float32")
    _check_all([f"d{n}" for n in names], grads, grads64, "float32")


def _inner_variant(name, dtype="float32", batch=2, dim=8, seqlen=13, dstate=4, rank=2):
    """_inner_inputs with the Jamba RMSNorms and/or given B/C and an x_proj without their columns."""
    a = _inner_inputs(batch=batch, dim=dim, seqlen=seqlen, dstate=dstate, rank=rank)
    rms = dict(b_rms_weight=_leaf((dstate,), offset=1.0, scale=0.3), c_rms_weight=_leaf((dstate,), offset=1.0, scale=0.3),
               dt_rms_weight=_leaf((dim,), offset=1.0, scale=0.3))
    if name == "rms":  # Jamba: all three norms, B and C projected
        a.update(rms, b_c_dt_rms_eps=1e-5)
    elif name == "given-B-rms":  # input-dependent B given (its bias unused), x_proj [dim, r + n]: C in the last n
        a.update(rms, B=_leaf((batch, dstate, seqlen)), x_proj_weight=_leaf((dim, rank + dstate), scale=0.4))
    elif name == "fixed-C":  # fixed C, x_proj [dim, r + n], dt norm only
        a.update(C=_leaf((dim, dstate)), x_proj_weight=_leaf((dim, rank + dstate), scale=0.4),
                 dt_rms_weight=rms["dt_rms_weight"])
    elif name == "both-given":  # grouped B and C given, x_proj [dim, r]: only delta projected
        a.update(B=_leaf((batch, 2, dstate, seqlen)), C=_leaf((batch, 2, dstate, seqlen)),
                 x_proj_weight=_leaf((dim, rank), scale=0.4), b_rms_weight=rms["b_rms_weight"],
                 c_rms_weight=rms["c_rms_weight"])
    elif name == "given-C-legacy":  # C given with x_proj [dim, r + 2n]: its columns and bias unused
        a.update(C=_leaf((batch, dstate, seqlen)))
    if dtype != "float32":
        for k in ("xz", "x_proj_weight", "delta_proj_weight", "out_proj_weight", "B", "C"):
            if k in a:
                a[k] = a[k].detach().astype(dtype)
                a[k].stop_gradient = False
    return a


INNER_VARIANTS = ("rms", "given-B-rms", "fixed-C", "both-given", "given-C-legacy")


@pytest.mark.parametrize("backend,checkpoint_lvl", [("triton", 0), ("triton", 1), ("reference", 1)])
@pytest.mark.parametrize("variant", INNER_VARIANTS)
def test_mamba_inner_fn_rms_and_given_bc(variant, backend, checkpoint_lvl):
    """B/C/dt RMSNorm weights and given B/C (x_proj without their columns): output and every gradient
    (the norm weights' and an unused bias's zero included) against the float64 composition."""
    a = _inner_variant(variant)
    out = mamba_inner_fn(**a, checkpoint_lvl=checkpoint_lvl, backend=backend)
    dout = randn(out.shape)
    names = sorted(n for n, t in a.items() if isinstance(t, paddle.Tensor))
    grads = paddle.grad(out, [a[n] for n in names], dout, allow_unused=True)
    a64 = {n: as_leaf64(t) if isinstance(t, paddle.Tensor) else t for n, t in a.items()}
    y64 = _inner64(a64)
    grads64 = paddle.grad(y64, [a64[n] for n in names], paddle.to_tensor(to64(dout)), allow_unused=True)
    assert_close("out", out.numpy(), y64.numpy(), "float32")
    for n, g, w in zip(names, grads, grads64):
        if w is None:  # unused by the composition (a given B's or C's projection bias): none or zero
            assert n.endswith("_proj_bias") and (g is None or np.array_equal(to64(g), np.zeros(g.shape))), n
        else:
            assert_close(f"d{n}", to64(g), w.numpy(), "float32")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_mamba_inner_fn_rms_low_precision(dtype):
    """Triton in fp16/bf16 with the norms: within the dtype's bound of the float64 composition, and no
    further from it than the reference backend in the same dtype (times 2)."""
    a = _inner_variant("given-B-rms", dtype=dtype)
    a64 = {n: as_leaf64(t) if isinstance(t, paddle.Tensor) else t for n, t in a.items()}
    y64 = _inner64(a64).numpy()
    ref_err = np.linalg.norm(to64(mamba_inner_fn(**a, backend="reference")) - y64) / np.linalg.norm(y64)
    out = mamba_inner_fn(**a, backend="triton")
    assert out.dtype == a["xz"].dtype
    assert_close("out", to64(out), y64, dtype, baseline_err=ref_err)


def test_mamba_inner_fn_torch_layout_and_reference_backend():
    a = _inner_inputs()
    ours = mamba_inner_fn(**a, backend="reference")
    torch_layout = dict(a, x_proj_weight=a["x_proj_weight"].T, delta_proj_weight=a["delta_proj_weight"].T,
                        out_proj_weight=a["out_proj_weight"].T)
    theirs = mamba_inner_fn(**torch_layout, is_paddle_linear=False, backend="reference")
    y64 = _inner64({n: as_leaf64(t) for n, t in a.items()})
    assert_close("reference backend", ours.numpy(), y64.numpy(), "float32")
    np.testing.assert_allclose(theirs.numpy(), ours.numpy(), rtol=1e-6, atol=1e-6)


# PaddleNLP 3.0.0b4 transformers/mamba/modeling.py MambaMixer with hidden 16, state 4, conv 4,
# expand 2 (inner 32), dt_rank ceil(16 / 16) = 1, use_bias=True, use_conv_bias=True
PADDLENLP_MIXER_PARAMS = {
    "A_log": [32, 4], "D": [32], "conv1d.weight": [32, 1, 4], "conv1d.bias": [32],
    "in_proj.weight": [16, 64], "in_proj.bias": [64], "x_proj.weight": [32, 9],
    "dt_proj.weight": [1, 32], "dt_proj.bias": [32], "out_proj.weight": [32, 16], "out_proj.bias": [16],
}


def test_mixer_parameters_match_paddlenlp():
    mixer = MambaMixer(d_model=16, d_state=4, d_conv=4, expand=2, use_bias=True)
    assert {k: list(v.shape) for k, v in mixer.state_dict().items()} == PADDLENLP_MIXER_PARAMS
    no_bias = MambaMixer(d_model=16, d_state=4)
    assert "in_proj.bias" not in no_bias.state_dict() and "out_proj.bias" not in no_bias.state_dict()


def test_mixer_prefill_then_decode_equals_full_forward():
    paddle.seed(np.random.randint(1 << 30))
    mixer = MambaMixer(d_model=8, d_state=3, d_conv=4, expand=2, backend="triton")
    hidden = randn((2, 9, 8))
    full = mixer(hidden)  # mamba_inner_fn
    cache = MambaInferenceCache(1, 2, mixer.intermediate_size, 3, 4)
    outs = [mixer(hidden[:, :6], cache_params=cache)]
    cache.seqlen_offset = 6
    for t in range(6, 9):
        outs.append(mixer(hidden[:, t:t + 1], cache_params=cache))
        cache.seqlen_offset += 1
    np.testing.assert_allclose(paddle.concat(outs, axis=1).numpy(), full.numpy(), rtol=1e-4, atol=1e-5)
    ref_mixer = MambaMixer(d_model=8, d_state=3, d_conv=4, expand=2, backend="reference")
    ref_mixer.set_state_dict(mixer.state_dict())
    np.testing.assert_allclose(ref_mixer(hidden).numpy(), full.numpy(), rtol=1e-4, atol=1e-5)


# ----------------------------------------------------------------------------------------------
# bad input


def test_bad_input_raises_clear_errors():
    x, w = randn((2, 4, 7)), randn((4, 3))
    with pytest.raises(ValueError, match="activation"):
        causal_conv1d_fn(x, w, activation="relu")
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_fn(x, randn((4, 0)))
    with pytest.raises(ValueError, match="weight"):
        causal_conv1d_fn(x, randn((5, 3)))
    with pytest.raises(ValueError, match="initial_states"):
        causal_conv1d_fn(x, w, initial_states=randn((2, 4, 3)))
    with pytest.raises(TypeError, match="seq_idx"):
        causal_conv1d_fn(x, w, seq_idx=randn((2, 7)))
    with pytest.raises(ValueError, match="conv_state"):
        causal_conv1d_update(randn((2, 4)), randn((2, 4, 1)), w)
    with pytest.raises(BackendUnavailableError, match="cuda"):
        causal_conv1d_fn(x, w, backend="cuda")
    u, A = randn((2, 4, 7)), randn((4, 3))
    with pytest.raises(ValueError, match="B"):
        selective_scan_fn(u, u, A, randn((2, 3, 6)), randn((2, 3, 7)))
    with pytest.raises(ValueError, match="B"):
        selective_scan_fn(u, u, A, randn((2, 3, 3, 7)), randn((2, 3, 7)))  # 3 groups do not divide dim 4
    with pytest.raises(ValueError, match="delta"):
        selective_scan_fn(u, randn((2, 4, 6)), A, randn((2, 3, 7)), randn((2, 3, 7)))
    with pytest.raises(ValueError, match="A"):
        selective_scan_fn(u, u, randn((5, 3)), randn((2, 3, 7)), randn((2, 3, 7)))
    with pytest.raises(TypeError, match="u"):
        selective_scan_fn(paddle.ones([2, 4, 7], dtype="int32"), u, A, randn((2, 3, 7)), randn((2, 3, 7)))
    with pytest.raises(BackendUnavailableError, match="cuda"):
        selective_scan_fn(u, u, A, randn((2, 3, 7)), randn((2, 3, 7)), backend="cuda")
    with pytest.raises(ValueError, match="B"):
        selective_state_update(randn((2, 4, 3)), randn((2, 4)), randn((2, 4)), A, randn((2, 2)), randn((2, 3)))
    a = _inner_inputs()
    with pytest.raises(ValueError, match="checkpoint_lvl"):
        mamba_inner_fn(**a, checkpoint_lvl=2)
    with pytest.raises(ValueError, match="x_proj_weight"):
        mamba_inner_fn(**dict(a, x_proj_weight=randn((8, 7))))
    for backend in BACKENDS:
        with pytest.raises(ValueError, match="x_proj_weight"):  # C given: r + n or r + 2n columns, not r
            mamba_inner_fn(**dict(a, C=randn((8, 4)), x_proj_weight=randn((8, 2))), backend=backend)
        with pytest.raises(ValueError, match="b_rms_weight"):
            mamba_inner_fn(**a, b_rms_weight=randn((3,)), backend=backend)
        with pytest.raises(ValueError, match="dt_rms_weight"):
            mamba_inner_fn(**a, dt_rms_weight=randn((4,)), backend=backend)
        with pytest.raises(ValueError, match="c_rms_weight.*fixed C"):
            mamba_inner_fn(**dict(a, C=randn((8, 4))), c_rms_weight=randn((4,)), backend=backend)
        with pytest.raises(TypeError, match="c_rms_weight"):
            mamba_inner_fn(**a, c_rms_weight=paddle.ones([4], dtype="int32"), backend=backend)
        with pytest.raises(ValueError, match="b_c_dt_rms_eps"):
            mamba_inner_fn(**a, dt_rms_weight=randn((8,)), b_c_dt_rms_eps=-1.0, backend=backend)
    with pytest.raises(ValueError, match="hidden_act"):
        MambaMixer(d_model=8, hidden_act="gelu")
    mixer = MambaMixer(d_model=8, d_state=3)
    for shape in ((2, 5, 9), (5, 8)):  # a wrong width, a missing batch axis: named before any matmul
        with pytest.raises(ValueError, match=r"hidden_states: expected \[batch, seqlen, hidden_size=8\]"):
            mixer(randn(shape))
