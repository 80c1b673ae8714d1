"""Mamba-2 SSD: the chunked reference and ``mamba_chunk_scan_combined`` against token recurrences.

The chunked algorithm (float32) is checked against the float64 token-by-token recurrence for values
and the gradients of every input; the recurrence itself against a plain numpy loop written here.
Shapes are tiny but odd: seqlen 19 with chunk 4 or 8 (a ragged last chunk), 4 heads in 1 or 2 groups."""

import numpy as np
import paddle
import pytest

from paddlenlp_fused.ops.ssd import mamba_chunk_scan_combined
from paddlenlp_fused.reference.ssd import selective_state_update_multihead_ref, ssd_chunked_ref, ssd_recurrence_ref
from paddlenlp_fused.runtime.backend import BackendUnavailableError
from paddlenlp_fused.testing.numerics import UNIT_ROUNDOFF, assert_close, assert_close_to_terms
from helpers import as_leaf64, randn, to64

BATCH, SEQLEN, NHEADS, HEADDIM, DSTATE = 2, 19, 4, 3, 5
GRAD_NAMES = ("x", "dt", "A", "B", "C", "D", "z", "dt_bias", "initial_states")


def _leaf(shape, scale=1.0, dtype="float32"):
    return randn(shape, dtype=dtype, scale=scale, requires_grad=True)


def _inputs(ngroups=2, d_shape="heads", batch=BATCH, seqlen=SEQLEN, dtype="float32"):
    A = paddle.to_tensor(-np.exp(np.random.randn(NHEADS) * 0.5).astype(np.float32))
    A.stop_gradient = False
    D_shape = (NHEADS,) if d_shape == "heads" else (NHEADS, HEADDIM)
    return dict(x=_leaf((batch, seqlen, NHEADS, HEADDIM), dtype=dtype), dt=_leaf((batch, seqlen, NHEADS), 0.5, dtype),
                A=A, B=_leaf((batch, seqlen, ngroups, DSTATE), dtype=dtype),
                C=_leaf((batch, seqlen, ngroups, DSTATE), dtype=dtype), D=_leaf(D_shape),
                z=_leaf((batch, seqlen, NHEADS, HEADDIM), dtype=dtype), dt_bias=_leaf((NHEADS,), 0.3),
                initial_states=_leaf((batch, NHEADS, HEADDIM, DSTATE)))


def _as64(a, per_token_A=True):
    """Float64 leaves of the same values; A as one leaf per token ([batch, seqlen, nheads], which
    ssd_recurrence_ref takes), so that _check_grads sees dA's per-token terms."""
    a64 = {k: as_leaf64(v) for k, v in a.items()}
    if per_token_A and "A" in a:
        a64["A"] = as_leaf64(paddle.expand(a["A"], a["dt"].shape))
    return a64


def _numpy_recurrence(a, softplus, limit):
    """Plain float64 loop, independent of paddlenlp_fused: (y, final state)."""
    x, dt, A, B, C, D, z, bias, h = (to64(a[k]) for k in ("x", "dt", "A", "B", "C", "D", "z", "dt_bias",
                                                          "initial_states"))
    dt = dt + bias
    if softplus:
        dt = np.where(dt > 20, dt, np.log1p(np.exp(dt)))
    dt = np.clip(dt, *limit)
    per_group = NHEADS // B.shape[2]
    ys = np.zeros_like(x)
    for t in range(x.shape[1]):
        for hd in range(NHEADS):
            g = hd // per_group
            h[:, hd] = np.exp(dt[:, t, hd] * A[hd])[:, None, None] * h[:, hd] + \
                (dt[:, t, hd, None] * x[:, t, hd])[:, :, None] * B[:, t, g, None, :]
            ys[:, t, hd] = np.einsum("bpn,bn->bp", h[:, hd], C[:, t, g])
    Dx = D[:, None] if D.ndim == 1 else D
    return (ys + Dx * x) * z / (1 + np.exp(-z)), h


# the Triton backward's 16-bit path rounds the operands of its GEMMs and its stored states to the
# dtype, as mamba_ssm's does: the plain computation's error is that chain's, not one rounding's. A dB
# element of a sum that does not cancel came out 2.9 units of roundoff off (float16; the reference,
# float32 inside, 1.0), 1.23x the one-rounding bound in 1 of 25 draws
TRITON_CHAIN_ROUNDINGS = 3


def _check_grads(outs, ins, outs64, ins64, names, dtype="float32", compare=None, baseline=None):
    """Gradients of <y, dy> + <final, dfinal> in both graphs agree for every name (or those in
    ``compare``); ``baseline``: the plain computation's error in a 16-bit ``dtype`` (DESIGN.md)."""
    cot = [randn(o.shape) for o in outs]
    grads = paddle.grad(outs, [ins[n] for n in names], [c.astype(o.dtype) for c, o in zip(cot, outs)])
    grads64 = paddle.grad(outs64, [ins64[n] for n in names], [paddle.to_tensor(to64(c)) for c in cot])
    for n, g, g64 in zip(names, grads, grads64):
        if compare is not None and n not in compare:
            continue
        if n == "A" and g64.ndim == 3:
            # dA sums one term per token: its error is measured against the sum of the terms' magnitudes
            # (DESIGN), as the sum itself can cancel far below them
            terms = g64.numpy()
            assert_close_to_terms("dA", to64(g), terms.sum((0, 1)), np.abs(terms).sum((0, 1)), dtype)
        else:
            assert_close(f"d{n}", to64(g), g64.numpy(), dtype, baseline_err=baseline)


def _chain_baseline(backend, dtype):
    return TRITON_CHAIN_ROUNDINGS * UNIT_ROUNDOFF[dtype] if backend == "triton" else None


@pytest.mark.parametrize("ngroups,d_shape,chunk,softplus,limit", [
    (1, "heads", 4, False, (0.0, float("inf"))),
    (2, "heads_headdim", 8, True, (0.0, float("inf"))),
    (2, "heads", 4, True, (0.5, 1.0)),  # clips about a third of dt, on both sides
])
def test_chunked_equals_recurrence_values_and_grads(ngroups, d_shape, chunk, softplus, limit):
    a = _inputs(ngroups, d_shape)
    if not softplus:  # dt stays positive without softplus
        a["dt"] = paddle.to_tensor(np.abs(a["dt"].numpy()) + 0.05, stop_gradient=False)
        a["dt_bias"] = paddle.to_tensor(np.abs(a["dt_bias"].numpy()), stop_gradient=False)
    y, final = ssd_chunked_ref(**a, chunk_size=chunk, dt_softplus=softplus, dt_limit=limit)
    a64 = _as64(a)
    y64, final64 = ssd_recurrence_ref(**a64, dt_softplus=softplus, dt_limit=limit)
    assert y.dtype == paddle.float32 and final.dtype == paddle.float32
    assert_close("y", y.numpy(), y64.numpy(), "float32")
    assert_close("final_states", final.numpy(), final64.numpy(), "float32")
    y_np, final_np = _numpy_recurrence(a, softplus, limit)
    np.testing.assert_allclose(y64.numpy(), y_np, rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(final64.numpy(), final_np, rtol=1e-10, atol=1e-10)
    _check_grads([y, final], a, [y64, final64], a64, GRAD_NAMES)


def test_op_matches_reference_and_optional_inputs():
    a = _inputs(ngroups=1)
    for drop in ((), ("D", "z", "dt_bias", "initial_states")):
        kw = {k: v for k, v in a.items() if k not in drop}
        y, final = mamba_chunk_scan_combined(**kw, chunk_size=8, dt_softplus=True, return_final_states=True,
                                             backend="reference")
        y64, final64 = ssd_recurrence_ref(**_as64(kw), dt_softplus=True)
        assert_close("y", y.numpy(), y64.numpy(), "float32")
        assert_close("final_states", final.numpy(), final64.numpy(), "float32")
    only_y = mamba_chunk_scan_combined(**a, chunk_size=8, dt_softplus=True, backend="reference")
    np.testing.assert_allclose(only_y.numpy(), ssd_chunked_ref(**a, chunk_size=8, dt_softplus=True)[0].numpy())


def _packed(lengths, ngroups=2):
    a = _inputs(ngroups, batch=1, seqlen=sum(lengths))
    bounds = np.concatenate([[0], np.cumsum(lengths)])
    return a, bounds


def test_varlen_cu_seqlens_equals_per_sequence_loop():
    lengths = (7, 1, 9, 4)  # cross chunk (4) boundaries, one single-token sequence
    a, bounds = _packed(lengths)
    cu = paddle.to_tensor(bounds.astype(np.int32))
    y, final, varlen = mamba_chunk_scan_combined(**a, chunk_size=4, cu_seqlens=cu, dt_softplus=True,
                                                 return_final_states=True, return_varlen_states=True,
                                                 backend="reference")
    assert list(varlen.shape) == [len(lengths), NHEADS, HEADDIM, DSTATE]
    a64 = _as64(a)
    pieces, finals = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):  # each sequence alone; only the first continues
        piece = {k: (v[:, s:e] if v.ndim >= 3 and k != "initial_states" else v) for k, v in a64.items()
                 if i == 0 or k != "initial_states"}
        y_i, h_i = ssd_recurrence_ref(**piece, dt_softplus=True)
        pieces.append(y_i)
        finals.append(h_i[0])
    y64, varlen64 = paddle.concat(pieces, axis=1), paddle.stack(finals)
    assert_close("y", y.numpy(), y64.numpy(), "float32")
    assert_close("varlen_states", varlen.numpy(), varlen64.numpy(), "float32")
    assert_close("final_states", final.numpy(), finals[-1].numpy()[None], "float32")
    _check_grads([y, varlen], a, [y64, varlen64], a64, GRAD_NAMES)


def test_seq_idx_runs_and_states_at_match_recurrence():
    a = _inputs(ngroups=1)
    # any values: the state restarts wherever seq_idx changes (row 1 returns to an earlier value)
    seq_idx = paddle.to_tensor(np.array([[0] * 5 + [1] * 9 + [2] * 5, [3] * 8 + [5] * 3 + [3] * 8], np.int64))
    positions = [0, 4, 13, 18]
    out = ssd_chunked_ref(**a, chunk_size=4, seq_idx=seq_idx, dt_softplus=True, states_at=positions)
    a64 = _as64(a)
    out64 = ssd_recurrence_ref(**a64, seq_idx=seq_idx, dt_softplus=True, states_at=positions)
    for name, o, o64 in zip(("y", "final_states", "states_at"), out, out64):
        assert_close(name, o.numpy(), o64.numpy(), "float32")
    _check_grads(list(out), a, list(out64), a64, GRAD_NAMES)
    op_y = mamba_chunk_scan_combined(**a, chunk_size=4, seq_idx=seq_idx.astype("int32"), dt_softplus=True,
                                     backend="reference")
    np.testing.assert_allclose(op_y.numpy(), out[0].numpy(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("ngroups", [1, 2])
def test_decoding_steps_continue_the_prefix(ngroups):
    a = _inputs(ngroups, d_shape="heads_headdim")
    prefix = 11
    with paddle.no_grad():
        y_full, final_full = mamba_chunk_scan_combined(**a, chunk_size=4, dt_softplus=True, return_final_states=True)
        head = {k: (v[:, :prefix] if v.ndim >= 3 and k != "initial_states" else v) for k, v in a.items()}
        _, state = mamba_chunk_scan_combined(**head, chunk_size=4, dt_softplus=True, return_final_states=True)
        steps = []
        for t in range(prefix, SEQLEN):
            steps.append(selective_state_update_multihead_ref(
                state, a["x"][:, t], a["dt"][:, t], a["A"], a["B"][:, t], a["C"][:, t], a["D"], a["z"][:, t],
                a["dt_bias"], dt_softplus=True))
    assert_close("decoded y", paddle.stack(steps, axis=1).numpy(), y_full[:, prefix:].numpy(), "float32")
    assert_close("decoded state", state.numpy(), final_full.numpy(), "float32")


@pytest.mark.parametrize("backend", ["reference", "triton"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_low_precision_inputs_compute_in_float32(dtype, backend):
    """16-bit inputs: y within the dtype's bound of the float64 recurrence on the same rounded values;
    the reference keeps the state exact in float32, the Triton kernels round the decay-weighted
    matmul operands to the dtype (as the bf16 GEMMs of mamba_ssm do), so their state gets the dtype's bound."""
    a = _inputs(ngroups=2, dtype=dtype)
    y, final = mamba_chunk_scan_combined(**a, chunk_size=8, dt_softplus=True, return_final_states=True,
                                         backend=backend)
    assert y.dtype == a["x"].dtype and final.dtype == paddle.float32
    a64 = _as64(a)  # the same (rounded) inputs in float64
    y64, final64 = ssd_recurrence_ref(**a64, dt_softplus=True)
    assert_close("y", to64(y), y64.numpy(), dtype)
    assert_close("final_states", final.numpy(), final64.numpy(), "float32" if backend == "reference" else dtype)
    # asked for every input (paddle.grad over a subset of a PyLayer's leaf inputs fails in Paddle 3.3: it
    # wants None returned for the leaves left out); compared for the per-token ones: dA, dD, ddt_bias and
    # dinitial_states sum cancelling terms over every token, so their relative error from a 16-bit
    # cotangent exceeds the dtype's bound for the reference just as for the kernels
    _check_grads([y], a, [y64], a64, GRAD_NAMES, dtype, compare=("x", "dt", "B", "C", "z"),
                 baseline=_chain_baseline(backend, dtype))


def test_bad_input_raises_clear_errors():
    a = {k: v for k, v in _inputs(ngroups=2).items()}

    def call(**over):
        kw = dict(a, chunk_size=4)
        kw.update(over)
        return mamba_chunk_scan_combined(**kw)

    with pytest.raises(ValueError, match="x"):
        call(x=randn((BATCH, SEQLEN, NHEADS)))
    with pytest.raises(ValueError, match="dt"):
        call(dt=randn((BATCH, SEQLEN - 1, NHEADS)))
    with pytest.raises(ValueError, match="A"):
        call(A=randn((NHEADS + 1,)))
    with pytest.raises(ValueError, match="ngroups dividing"):
        call(B=randn((BATCH, SEQLEN, 3, DSTATE)), C=randn((BATCH, SEQLEN, 3, DSTATE)))
    with pytest.raises(ValueError, match="C"):
        call(C=randn((BATCH, SEQLEN, 2, DSTATE + 1)))
    with pytest.raises(ValueError, match="D"):
        call(D=randn((HEADDIM,)))
    with pytest.raises(ValueError, match="z"):
        call(z=randn((BATCH, SEQLEN, NHEADS, HEADDIM + 1)))
    with pytest.raises(ValueError, match="initial_states"):
        call(initial_states=randn((BATCH, NHEADS, HEADDIM, DSTATE + 1)))
    for bad in (0, -3, 2.5):
        with pytest.raises(ValueError, match="chunk_size"):
            call(chunk_size=bad)
    with pytest.raises(TypeError, match="seq_idx"):
        call(seq_idx=randn((BATCH, SEQLEN)))
    with pytest.raises(TypeError, match="x"):
        call(x=paddle.ones([BATCH, SEQLEN, NHEADS, HEADDIM], dtype="int32"))
    with pytest.raises(ValueError, match="dt_limit"):
        call(dt_limit=(1.0, 0.5))
    with pytest.raises(ValueError, match="cu_seqlens"):  # batch 2
        call(cu_seqlens=paddle.to_tensor(np.array([0, 10, SEQLEN], np.int32)))
    packed, bounds = _packed((7, 5))
    for bad in ([0, 7, 11], [1, 7, 12], [0, 7, 7, 12], [0, 8, 6, 12]):
        with pytest.raises(ValueError, match="cu_seqlens"):
            mamba_chunk_scan_combined(**packed, chunk_size=4, cu_seqlens=paddle.to_tensor(np.array(bad, np.int32)))
    with pytest.raises(ValueError, match="return_varlen_states"):
        mamba_chunk_scan_combined(**packed, chunk_size=4, return_varlen_states=True)
    for backend in ("reference", "triton"):
        for bad, error in (("float64", ValueError), ("float16", ValueError), ("int32", ValueError),
                           (paddle.float16, ValueError), (3, TypeError)):  # x is float32
            with pytest.raises(error, match="state_dtype"):
                mamba_chunk_scan_combined(**packed, chunk_size=4, state_dtype=bad, backend=backend)
    with pytest.raises(BackendUnavailableError, match="chunk_size"):
        call(backend="triton", chunk_size=6)


# ---------------------------------------------------------------------------------------------------
# Triton backend (interpreter): kernels of kernels/triton/ssd.py (forward) and ssd_backward.py


TRITON_CASES = {  # name: (ngroups, D shape, chunk, seqlen, options)
    "minimal": (1, "heads", 4, SEQLEN, dict(drop=("z", "dt_bias", "initial_states"))),
    "all_options_clipped": (2, "heads_headdim", 8, SEQLEN, dict(softplus=True, limit=(0.5, 1.0))),
    "groups_equal_heads": (4, "heads", 16, SEQLEN, dict(softplus=True, drop=("z",))),
    "seqlen_1": (2, "heads_headdim", 4, 1, dict(softplus=True)),
    "one_chunk_no_D": (1, "heads", 16, 16, dict(softplus=True, drop=("D", "initial_states"))),
}


@pytest.mark.parametrize("case", list(TRITON_CASES))
def test_triton_matches_recurrence_values_and_grads(case):
    ngroups, d_shape, chunk, seqlen, opts = TRITON_CASES[case]
    a = {k: v for k, v in _inputs(ngroups, d_shape, seqlen=seqlen).items() if k not in opts.get("drop", ())}
    softplus, limit = opts.get("softplus", False), opts.get("limit", (0.0, float("inf")))
    if not softplus:  # dt stays positive without softplus
        a["dt"] = paddle.to_tensor(np.abs(a["dt"].numpy()) + 0.05, stop_gradient=False)
    y, final = mamba_chunk_scan_combined(**a, chunk_size=chunk, dt_softplus=softplus, dt_limit=limit,
                                         return_final_states=True, backend="triton")
    a64 = _as64(a)
    y64, final64 = ssd_recurrence_ref(**a64, dt_softplus=softplus, dt_limit=limit)
    assert_close("y", y.numpy(), y64.numpy(), "float32")
    assert_close("final_states", final.numpy(), final64.numpy(), "float32")
    _check_grads([y, final], a, [y64, final64], a64, [n for n in GRAD_NAMES if n in a])


def test_triton_seq_idx_values_and_grads():
    a = _inputs(ngroups=2)
    # arbitrary values; row 1 returns to an earlier value, which starts a new run all the same
    seq_idx = paddle.to_tensor(np.array([[0] * 5 + [1] * 9 + [2] * 5, [3] * 8 + [5] * 3 + [3] * 8], np.int32))
    y, final = mamba_chunk_scan_combined(**a, chunk_size=4, seq_idx=seq_idx, dt_softplus=True,
                                         return_final_states=True, backend="triton")
    a64 = _as64(a)
    y64, final64 = ssd_recurrence_ref(**a64, seq_idx=seq_idx, dt_softplus=True)
    assert_close("y", y.numpy(), y64.numpy(), "float32")
    assert_close("final_states", final.numpy(), final64.numpy(), "float32")
    _check_grads([y, final], a, [y64, final64], a64, GRAD_NAMES)


def test_triton_varlen_states_equal_per_sequence_loop():
    lengths = (7, 1, 9, 4)  # cross chunk (4) boundaries, one single-token sequence
    a, bounds = _packed(lengths)
    cu = paddle.to_tensor(bounds.astype(np.int64))
    y, final, varlen = mamba_chunk_scan_combined(**a, chunk_size=4, cu_seqlens=cu, dt_softplus=True,
                                                 return_final_states=True, return_varlen_states=True,
                                                 backend="triton")
    assert not varlen.stop_gradient
    a64 = _as64(a)
    pieces, finals = [], []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):  # each sequence alone; only the first continues
        piece = {k: (v[:, s:e] if v.ndim >= 3 and k != "initial_states" else v) for k, v in a64.items()
                 if i == 0 or k != "initial_states"}
        y_i, h_i = ssd_recurrence_ref(**piece, dt_softplus=True)
        pieces.append(y_i)
        finals.append(h_i[0])
    y64 = paddle.concat(pieces, axis=1)
    assert_close("y", y.numpy(), y64.numpy(), "float32")
    assert_close("varlen_states", varlen.numpy(), paddle.stack(finals).numpy(), "float32")
    assert_close("final_states", final.numpy(), finals[-1].numpy()[None], "float32")
    # y, the last final state and every varlen state at once (the kernels' and the composition's gradients add)
    _check_grads([y, final, varlen], a, [y64, finals[-1][None], paddle.stack(finals)], a64, GRAD_NAMES)
    with paddle.no_grad():  # no gradient can reach them: the forward kernels' states, the same values
        _, kernel_varlen = mamba_chunk_scan_combined(**a, chunk_size=4, cu_seqlens=cu, dt_softplus=True,
                                                     return_varlen_states=True, backend="triton")
    assert kernel_varlen.stop_gradient
    assert_close("varlen_states (kernels)", kernel_varlen.numpy(), paddle.stack(finals).numpy(), "float32")


def test_varlen_states_ref_on_long_strongly_decaying_sequences():
    """The Triton backend's differentiable varlen states (``varlen_states_ref``), which sum the log decay
    from each sequence's end, within float32's bound of the float64 recurrence where a sequence's total
    log decay passes 1e3."""
    from paddlenlp_fused.reference.ssd import varlen_states_ref

    lengths = (300, 57)
    a, bounds = _packed(lengths)
    a["A"] = paddle.to_tensor(-np.abs(a["A"].numpy()) * 4 - 1)
    a["dt"] = paddle.to_tensor(np.abs(a["dt"].numpy()) + 0.5)
    states = varlen_states_ref(a["x"], a["dt"], a["A"], a["B"], bounds, a["dt_bias"], a["initial_states"],
                               dt_softplus=True)
    a64 = _as64(a, per_token_A=False)
    finals = []
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:])):
        piece = {k: (v[:, s:e] if v.ndim >= 3 and k != "initial_states" else v) for k, v in a64.items()
                 if i == 0 or k != "initial_states"}
        finals.append(ssd_recurrence_ref(**piece, dt_softplus=True)[1][0])
    assert float(paddle.abs(paddle.to_tensor(a["dt"].numpy() * a["A"].numpy())).sum()) > 1e3
    assert_close("varlen_states", states.numpy(), paddle.stack(finals).numpy(), "float32")


CONTRACT_VARIANTS = {  # SSDConfig options; every variant runs two token tiles per chunk in the chunk scan
    "default": {},  # stages 3 and 4 apart (small problem), chunk scan walking its token tiles, loading CB
    "fused_state_passing": dict(fuse_state_passing=True),  # two token blocks per step of the fused kernel
    "recompute_cb": dict(recompute_cb=True, scan_m_loop=False, scan_heads_first=False, split_scores=False),
    "load_cb_per_tile": dict(scan_m_loop=False),
}


@pytest.mark.parametrize("variant", list(CONTRACT_VARIANTS))
def test_triton_saved_buffers_follow_the_backward_contract(variant):
    """dt_out, dA_cumsum, the entering states (with seq_idx resets), CB and final_states as
    ssd_backward reads them, for the kernel variants of ``CONTRACT_VARIANTS`` (stages 3 and 4 as two
    kernels or fused into one, runs starting inside token blocks; the chunk scan recomputing C.B
    blocks or loading CB, one program per token tile or walking the chunk's token tiles)."""
    from paddlenlp_fused.kernels.triton import ssd as K
    from paddlenlp_fused.reference.ssd import process_dt
    from paddlenlp_fused.runtime.triton_paddle import triton_args

    chunk, ngroups = 8, 2
    a = _inputs(ngroups)
    nchunks = -(-SEQLEN // chunk)
    buf = {k: paddle.full(list(v), float("nan"), "float32")
           for k, v in K.buffer_shapes(BATCH, SEQLEN, NHEADS, HEADDIM, ngroups, DSTATE, chunk).items()}
    out, out_x = (paddle.full(a["x"].shape, float("nan"), "float32") for _ in range(2))
    runs = paddle.to_tensor(np.array([[0] * 5 + [1] * 9 + [2] * 5, [0] * 8 + [1] * 11], np.int64))  # run ids
    t = triton_args(a["x"], a["dt"], a["A"], a["B"], a["C"], out, buf["dt_out"], buf["dA_cumsum"], buf["states"],
                    buf["CB"], buf["final_states"], a["D"], a["z"], out_x, a["dt_bias"], a["initial_states"], runs)
    K.ssd_chunked_fwd(*t[:11], chunk_size=chunk, D=t[11], z=t[12], out_x=t[13], dt_bias=t[14],
                      initial_states=t[15], seq_idx=t[16], dt_softplus=True,
                      config=K.SSDConfig(fused_block_k=chunk // 2, scan_block_m=chunk // 2,
                                         **CONTRACT_VARIANTS[variant]))
    a64 = _as64(a, per_token_A=False)
    ends = [c * chunk - 1 for c in range(1, nchunks)]
    y64, final64, at64 = ssd_recurrence_ref(**{**a64, "z": None}, seq_idx=runs, dt_softplus=True, states_at=ends)
    assert_close("out_x", out_x.numpy(), y64.numpy(), "float32")
    states64 = np.concatenate([a64["initial_states"].numpy()[:, None], at64.numpy()], axis=1)
    assert_close("states", buf["states"].numpy(), states64, "float32")
    assert_close("final_states", buf["final_states"].numpy(), final64.numpy(), "float32")
    dt64 = process_dt(a64["dt"], a64["dt_bias"], True, (0.0, float("inf")), "float64").numpy()
    dt64 = np.pad(dt64, ((0, 0), (0, nchunks * chunk - SEQLEN), (0, 0)))
    dt64 = dt64.reshape(BATCH, nchunks, chunk, NHEADS).transpose(0, 3, 1, 2)             # [b, h, c, K]
    assert_close("dt_out", buf["dt_out"].numpy(), dt64, "float32")
    cs64 = np.cumsum(dt64 * a64["A"].numpy()[None, :, None, None], axis=-1)
    assert_close("dA_cumsum", buf["dA_cumsum"].numpy(), cs64, "float32")
    pad = lambda v: np.pad(v, ((0, 0), (0, nchunks * chunk - SEQLEN), (0, 0), (0, 0)))  # noqa: E731
    Bk = pad(a64["B"].numpy()).reshape(BATCH, nchunks, chunk, ngroups, DSTATE)
    Ck = pad(a64["C"].numpy()).reshape(BATCH, nchunks, chunk, ngroups, DSTATE)
    assert_close("CB", buf["CB"].numpy(), np.einsum("bctgn,bcsgn->bcgts", Ck, Bk), "float32")


def test_triton_states_in_x_dtype():
    """bf16 x with stages 3+4 fused: ``states_dtype`` gives bf16 states, which are the fp32 ones rounded,
    with the same y and final states (the chunk scan rounds the state to bf16 either way); the unfused
    state passing refuses a bf16 buffer."""
    from paddlenlp_fused.kernels.triton import ssd as K
    from paddlenlp_fused.runtime.triton_paddle import triton_args

    chunk, ngroups = 8, 2
    fused, apart = K.SSDConfig(fuse_state_passing=True), K.SSDConfig(fuse_state_passing=False)
    assert K.states_dtype("bfloat16", BATCH, NHEADS, fused) == "bfloat16"
    assert K.states_dtype("bfloat16", BATCH, NHEADS, apart) == "float32"
    assert K.states_dtype("float32", BATCH, NHEADS, fused) == "float32"
    a = _inputs(ngroups, dtype="bfloat16")
    shapes = K.buffer_shapes(BATCH, SEQLEN, NHEADS, HEADDIM, ngroups, DSTATE, chunk)

    def forward(states_dtype, config):
        buf = {k: paddle.full(list(v), float("nan"), states_dtype if k == "states" else "float32")
               for k, v in shapes.items()}
        out = paddle.full(a["x"].shape, float("nan"), "bfloat16")
        t = triton_args(a["x"], a["dt"], a["A"], a["B"], a["C"], out, buf["dt_out"], buf["dA_cumsum"], buf["states"],
                        buf["CB"], buf["final_states"], a["D"], a["dt_bias"], a["initial_states"])
        K.ssd_chunked_fwd(*t[:11], chunk_size=chunk, D=t[11], dt_bias=t[12], initial_states=t[13], dt_softplus=True,
                          config=config)
        return out.astype("float32").numpy(), {k: v.astype("float32").numpy() for k, v in buf.items()}

    out32, buf32 = forward("float32", fused)
    out16, buf16 = forward("bfloat16", fused)
    assert not np.isnan(out16).any()
    np.testing.assert_array_equal(out16, out32)
    np.testing.assert_array_equal(buf16["final_states"], buf32["final_states"])
    rounded = paddle.to_tensor(buf32["states"]).astype("bfloat16").astype("float32").numpy()
    np.testing.assert_array_equal(buf16["states"], rounded)
    with pytest.raises(TypeError, match="states"):
        forward("bfloat16", apart)


@pytest.mark.parametrize("state_dtype", [None, "float32", paddle.bfloat16])
def test_state_dtype_sets_the_stored_states(state_dtype, monkeypatch):
    """bf16 x with stages 3+4 fused: the forward's chunk states are stored bf16 by default or for
    x's dtype, float32 for state_dtype float32; y, final states and the per-token gradients stay within
    bf16's bound of the float64 recurrence on both backends, and the returned final states are float32."""
    from paddlenlp_fused.kernels.triton import ssd as K

    monkeypatch.setattr(K, "DEFAULT_CONFIG", K.SSDConfig(fuse_state_passing=True))
    seen, launch = [], K.ssd_chunked_fwd
    monkeypatch.setattr(K, "ssd_chunked_fwd", lambda *t, **kw: (seen.append(t[8].dtype), launch(*t, **kw))[1])
    a = _inputs(ngroups=2, dtype="bfloat16")
    a64 = _as64(a)
    y64, final64 = ssd_recurrence_ref(**a64, dt_softplus=True)
    for backend in ("triton", "reference"):
        y, final = mamba_chunk_scan_combined(**a, chunk_size=8, dt_softplus=True, return_final_states=True,
                                             state_dtype=state_dtype, backend=backend)
        assert y.dtype == paddle.bfloat16 and final.dtype == paddle.float32
        assert_close(f"y ({backend})", to64(y), y64.numpy(), "bfloat16")
        assert_close(f"final_states ({backend})", final.numpy(), final64.numpy(), "bfloat16")
        # the per-token gradients; dA, dD, ddt_bias, dinitial_states sum cancelling terms over every token
        # (see test_low_precision_inputs_compute_in_float32)
        _check_grads([y, final], a, [y64, final64], a64, GRAD_NAMES, dtype="bfloat16",
                     compare=("x", "dt", "B", "C", "z"), baseline=_chain_baseline(backend, "bfloat16"))
    assert seen == [paddle.float32 if state_dtype == "float32" else paddle.bfloat16]


def test_triton_chunk_sizes_and_fallback():
    from paddlenlp_fused.kernels.triton import ssd as K

    a = _inputs(ngroups=1)
    with paddle.no_grad():  # chunk 6 is not a power of two: auto takes the reference, which gives the same
        y_auto = mamba_chunk_scan_combined(**a, chunk_size=6, dt_softplus=True)
        y_ref = mamba_chunk_scan_combined(**a, chunk_size=6, dt_softplus=True, backend="reference")
    np.testing.assert_array_equal(y_auto.numpy(), y_ref.numpy())
    for bad in (0, 6, 12, 2.0, True):
        with pytest.raises(ValueError, match="chunk_size"):
            K.check_chunk_size(bad)
