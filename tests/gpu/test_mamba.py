"""Mamba-1 selective scan kernels on the GPU (CUDA and Triton) against float64 numpy
recurrences with hand-written adjoints: every dtype, odd shapes, seqlen 32768, tensors past 2^31
elements (64-bit offsets). Outputs are poisoned (NaN) before the kernels write them."""

import numpy as np
import pytest

from paddlenlp_fused.kernels.cuda import selective_scan as cuda_scan
from paddlenlp_fused.kernels.triton import selective_scan as scan_kernels
from paddlenlp_fused.testing.numerics import assert_close
from paddlenlp_fused.testing.scan_reference import selective_scan_reference

DTYPES = ("float32", "float16", "bfloat16")


# ----------------------------------------------------------------------------------------------
# selective scan

# (batch, dim, seqlen, dstate, B/C kind, options). The CUDA backward walks 256-step chunks in reverse
# (seqlen 1000: 4, the last partial), a forward lane holds 16 steps; grouped3 has 15 dims a group
# (blocks of one warp), grouped 12 (blocks of 4 warps); seqlen 300 and 257 have unaligned rows.
SCAN_SHAPES = [
    (1, 1, 1, 1, "variable", True),
    (2, 37, 300, 16, "variable", True),
    (3, 64, 1000, 4, "fixed", False),
    (2, 48, 257, 16, "grouped", True),
    (2, 45, 520, 8, "grouped3", True),
    (1, 20, 513, 64, "variable", False),
]
SCAN_KERNELS = {"cuda": cuda_scan, "triton": scan_kernels}  # backend -> launcher module


def _scan_tensors(provider, batch, dim, seqlen, dstate, kind, options, dtype):
    groups = {"grouped": 4, "grouped3": 3}.get(kind, 1)
    assert dim % groups == 0
    bc_shape = {"fixed": (dim, dstate), "variable": (batch, dstate, seqlen)}.get(kind, (batch, groups, dstate, seqlen))
    t = dict(u=provider.randn((batch, dim, seqlen), dtype),
             # delta is a step size: through softplus when ``options``, else drawn positive (a negative
             # step makes exp(delta * A) > 1 and the state grows past the float16 range over 1000 steps)
             delta=provider.randn((batch, dim, seqlen), dtype, scale=0.5, offset=-1.0) if options else
             provider.from_numpy(np.abs(np.random.randn(batch, dim, seqlen)) * 0.5 + 0.05, dtype),
             A=provider.from_numpy(-np.exp(np.random.randn(dim, dstate) * 0.5), "float32"),
             B=provider.randn(bc_shape, dtype if kind != "fixed" else "float32"),
             C=provider.randn(bc_shape, dtype if kind != "fixed" else "float32"))
    t.update(D=provider.randn((dim,), "float32") if options else None,
             z=provider.randn((batch, dim, seqlen), dtype) if options else None,
             delta_bias=provider.randn((dim,), "float32", scale=0.3) if options else None)
    return t


def _run_scan(provider, backend, t, softplus, dout, plan=None, fwd_options=None, bwd_options=None):
    """Forward and backward of ``backend`` (a SCAN_KERNELS key) with every output poisoned; ``plan``
    and the launch options default to the launchers' own."""
    kernels = SCAN_KERNELS[backend]
    u = t["u"]
    batch, dim, seqlen = u.shape
    dstate = t["A"].shape[1]
    plan = plan or kernels.scan_plan(seqlen)
    dtype = str(u.dtype).split(".")[-1]
    out, last = provider.poisoned(u.shape, dtype), provider.poisoned((batch, dim, dstate), "float32")
    states = provider.poisoned(kernels.states_shape(batch, dim, dstate, plan), "float32")
    args = [t[k] for k in ("u", "delta", "A", "B", "C")]
    kernels.selective_scan_fwd(*args, out, t["D"], t["z"], t["delta_bias"], states, last,
                               delta_softplus=softplus, plan=plan, **(fwd_options or {}))
    du, ddelta = provider.poisoned(u.shape, dtype), provider.poisoned(u.shape, dtype)
    dz = provider.poisoned(u.shape, dtype) if t["z"] is not None else None
    out_z = provider.poisoned(u.shape, dtype) if t["z"] is not None else None
    work_shape = kernels.workspace_shape(batch, dim, dstate, plan)
    work = None if work_shape is None else provider.poisoned(work_shape, "float32")
    acc = {k: provider.zeros(t[k].shape, "float32") if t[k] is not None else None
           for k in ("A", "B", "C", "D", "delta_bias")}
    kernels.selective_scan_bwd(*args, dout, states, work, du, ddelta, acc["A"], acc["B"], acc["C"], t["D"],
                               t["z"], t["delta_bias"], acc["D"], dz, acc["delta_bias"], out_z,
                               delta_softplus=softplus, plan=plan, **(bwd_options or {}))
    provider.synchronize()
    return out, last, out_z, dict(du=du, ddelta=ddelta, dA=acc["A"], dB=acc["B"], dC=acc["C"], dD=acc["D"], dz=dz,
                                  ddelta_bias=acc["delta_bias"])


def _check_scan(provider, t, softplus, dout, out, last, out_z, grads, dtype):
    np_t = {k: None if v is None else provider.to_numpy(v) for k, v in t.items()}
    ref_out, ref_last, ref_grads, _ = selective_scan_reference(**np_t, softplus=softplus, dout=provider.to_numpy(dout))
    assert_close("out", provider.to_numpy(out), ref_out, dtype)
    assert_close("last_state", provider.to_numpy(last), ref_last, "float32" if dtype == "float32" else dtype)
    if out_z is not None:
        assert_close("out_z", provider.to_numpy(out_z), ref_out, dtype)
    for name, g in grads.items():
        if g is not None:
            assert_close(name, provider.to_numpy(g), ref_grads[name], dtype)


@pytest.mark.parametrize("backend", sorted(SCAN_KERNELS))
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SCAN_SHAPES, ids=str)
def test_scan_fwd_bwd_match_float64(provider, shape, dtype, backend):
    batch, dim, seqlen, dstate, kind, options = shape
    t = _scan_tensors(provider, batch, dim, seqlen, dstate, kind, options, dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    out, last, out_z, grads = _run_scan(provider, backend, t, options, dout)
    _check_scan(provider, t, options, dout, out, last, out_z, grads, dtype)


@pytest.mark.parametrize("backend", sorted(SCAN_KERNELS))
def test_scan_strided_inputs(provider, backend):
    """u, delta, z, dout as [b, l, d] memory viewed as [b, d, l]; B, C as [b, l, n] viewed as
    [b, n, l] (element-wise loads: no vector path)."""
    batch, dim, seqlen, dstate, dtype = 2, 24, 333, 16, "bfloat16"
    t = _scan_tensors(provider, batch, dim, seqlen, dstate, "variable", True, dtype)
    for k in ("u", "delta", "z", "B", "C"):
        t[k] = t[k].transpose(1, 2).contiguous().transpose(1, 2)
    dout = provider.randn((batch, seqlen, dim), dtype).transpose(1, 2)
    out, last, out_z, grads = _run_scan(provider, backend, t, True, dout)
    _check_scan(provider, t, True, dout, out, last, out_z, grads, dtype)


# Triton launch configurations other than the defaults (the benchmark's sweep times some): plan,
# forward and backward options (block_d dims a program, dim_regs of them in each thread).
TRITON_CONFIGS = [
    (dict(bwd_chunk=8), dict(block_d=64), dict(block_d=8, dim_regs=1)),
    (dict(seg_chunks=1), dict(block_d=16), dict(dim_regs=4)),
    (dict(chunk=4, seg_chunks=3, bwd_chunk=2), dict(), dict(block_d=32, num_warps=2)),
    (dict(chunk=16, bwd_chunk=16), dict(), dict(block_d=4, dim_regs=1)),
    (dict(), dict(), dict(block_d=8)),
    (dict(bwd_chunk=8), dict(), dict()),
]


@pytest.mark.parametrize("config", TRITON_CONFIGS, ids=str)
def test_triton_scan_launch_configs(provider, config):
    plan_options, fwd_options, bwd_options = config
    batch, dim, seqlen, dstate, dtype = 2, 48, 300, 16, "bfloat16"
    t = _scan_tensors(provider, batch, dim, seqlen, dstate, "variable", True, dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    plan = scan_kernels.scan_plan(seqlen, **plan_options)
    out, last, out_z, grads = _run_scan(provider, "triton", t, True, dout, plan, fwd_options, bwd_options)
    _check_scan(provider, t, True, dout, out, last, out_z, grads, dtype)


# (batch, dim, seqlen, dstate, B/C kind, options): input-dependent B/C over 6 blocks of dims, fixed B/C
# over 3 batch rows, grouped B/C over 3 blocks a group
DETERMINISTIC_SHAPES = [(4, 96, 1000, 16, "variable", True), (3, 64, 777, 8, "fixed", True),
                        (2, 48, 257, 16, "grouped", False)]


@pytest.mark.parametrize("dtype", ("float32", "bfloat16"))
@pytest.mark.parametrize("shape", DETERMINISTIC_SHAPES, ids=str)
def test_triton_scan_deterministic_backward_bit_identical(provider, shape, dtype):
    """The partials path (each program's sums in its own workspace slot, then a fixed-order add):
    several programs add into every accumulated gradient (batch rows; blocks of dims of a group for
    input-dependent B/C); within float64's bounds, and two runs bit-identical in every gradient."""
    batch, dim, seqlen, dstate, kind, options = shape
    t = _scan_tensors(provider, batch, dim, seqlen, dstate, kind, options, dtype)
    dout = provider.randn((batch, dim, seqlen), dtype)
    layout = scan_kernels.bwd_partials_layout(t["u"], t["A"], t["B"], t["C"], t["D"], t["delta_bias"])
    runs = []
    for _ in range(2):
        partials = provider.poisoned((layout["numel"],), "float32")  # contents ignored
        out, last, out_z, grads = _run_scan(provider, "triton", t, options, dout, bwd_options=dict(partials=partials))
        runs.append({name: provider.to_numpy(g) for name, g in grads.items() if g is not None})
    _check_scan(provider, t, options, dout, out, last, out_z, grads, dtype)
    for name in runs[0]:
        assert np.array_equal(runs[0][name], runs[1][name]), f"{name}: two deterministic runs differ"


def _each_backend(provider, t, dout, check):
    """Runs every backend on the same tensors and ``check``s it; the failures of all are reported."""
    failures = []
    for backend in SCAN_KERNELS:
        out, last, _, grads = _run_scan(provider, backend, t, True, dout)
        try:
            check(out, last, grads)
        except AssertionError as exc:
            failures.append(f"{backend}: {exc}")
        del out, last, grads
    assert not failures, "; ".join(failures)


def test_scan_seqlen_32768(provider):
    batch, dim, seqlen, dstate = 1, 64, 32768, 16
    t = _scan_tensors(provider, batch, dim, seqlen, dstate, "variable", True, "bfloat16")
    dout = provider.randn((batch, dim, seqlen), "bfloat16")
    np_t = {k: None if v is None else provider.to_numpy(v) for k, v in t.items()}
    ref_out, ref_last, ref_grads, _ = selective_scan_reference(**np_t, softplus=True, dout=provider.to_numpy(dout))

    def check(out, last, grads):
        assert_close("out", provider.to_numpy(out), ref_out, "bfloat16")
        assert_close("last_state", provider.to_numpy(last), ref_last, "bfloat16")
        for name in ("du", "ddelta", "dA", "dB", "dC", "dD", "dz", "ddelta_bias"):
            assert_close(name, provider.to_numpy(grads[name]), ref_grads[name], "bfloat16")
    _each_backend(provider, t, dout, check)


@pytest.mark.xdist_group("huge")
def test_scan_past_2_31_elements(provider):
    """u, delta, z, out [2, 16384, 65537] bf16: 2^31 + 32768 elements each. The last batch's last dims
    live past 2^31; they are checked against float64 (forward and backward)."""
    batch, dim, seqlen, dstate = 2, 16384, 65537, 16
    assert batch * dim * seqlen > 2**31
    t = _scan_tensors(provider, batch, dim, seqlen, dstate, "variable", True, "bfloat16")
    dout = provider.randn((batch, dim, seqlen), "bfloat16")
    rows = slice(dim - 3, dim)
    sub = {k: provider.to_numpy(t[k][1:, rows]) for k in ("u", "delta", "z")}  # slice on the device first
    sub.update({k: provider.to_numpy(t[k][rows]) for k in ("A", "D", "delta_bias")})
    sub.update({k: provider.to_numpy(t[k][1:]) for k in ("B", "C")})
    ref_out, ref_last, ref_grads, _ = selective_scan_reference(**sub, softplus=True,
                                                               dout=provider.to_numpy(dout[1:, rows]))

    def check(out, last, grads):
        assert_close("out tail", provider.to_numpy(out[1:, rows]), ref_out, "bfloat16")
        assert_close("last_state tail", provider.to_numpy(last[1:, rows]), ref_last, "bfloat16")
        for name in ("du", "ddelta", "dz"):
            assert_close(f"{name} tail", provider.to_numpy(grads[name][1:, rows]), ref_grads[name], "bfloat16")
    _each_backend(provider, t, dout, check)
