"""SSD backward launcher (Triton interpreter) against Paddle float64 autograd of ``ssd_chunked_ref``.

The forward intermediates the launcher takes (processed dt, in-chunk cumsum of dt*A, the state
entering each chunk, C.B^T per chunk, y before the gate) are built here in float64 numpy from the
reference's math, then cast to what the forward saves (fp32, out_x in x's dtype). Every gradient
buffer is poisoned (NaN) or, for the atomically accumulated ones, zeroed as the contract says. dA,
ddt_bias and dD (sums over every token) are measured against the sum of their terms' magnitudes.
"""

import math

import numpy as np
import paddle
import pytest

from paddlenlp_fused.kernels.triton.ssd_backward import ssd_chunked_bwd, workspace_shapes
from paddlenlp_fused.reference.ssd import segment_ids, ssd_chunked_ref
from paddlenlp_fused.runtime.triton_paddle import triton_args
from paddlenlp_fused.testing.numerics import assert_close, assert_close_to_terms, rel_err, silu
from helpers import deterministic_settings, to64


def _process_dt64(dt, dt_bias, softplus, limit):
    v = dt + (dt_bias if dt_bias is not None else 0.0)
    if softplus:
        v = np.where(v > 20.0, v, np.log1p(np.exp(np.minimum(v, 20.0))))
    lo, hi = limit
    if lo > 0.0 or hi < math.inf:
        v = np.clip(v, lo, hi)
    return v


def build_intermediates(x, dt, A, B, C, K, dt_bias, initial_states, seg, softplus, limit):
    """float64 numpy: dt_out, dA_cumsum [b, h, nc, K]; states [b, nc, h, P, N]; CB [b, nc, g, K, K]."""
    batch, seqlen, nheads, P = x.shape
    ngroups, N = B.shape[2], B.shape[3]
    nc = -(-seqlen // K)
    pad = nc * K - seqlen
    dtp = np.pad(_process_dt64(dt, dt_bias, softplus, limit), ((0, 0), (0, pad), (0, 0)))
    xp = np.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0)))
    Bp = np.pad(B, ((0, 0), (0, pad), (0, 0), (0, 0)))
    Cp = np.pad(C, ((0, 0), (0, pad), (0, 0), (0, 0)))
    segp = np.zeros((batch, nc * K), np.int64) if seg is None else np.pad(seg, ((0, 0), (0, pad)), mode="edge")
    dt_out = dtp.reshape(batch, nc, K, nheads).transpose(0, 3, 1, 2)
    cs = np.cumsum(dt_out * A[None, :, None, None], axis=-1)
    Bk, Ck = Bp.reshape(batch, nc, K, ngroups, N), Cp.reshape(batch, nc, K, ngroups, N)
    CB = np.einsum("bctgn,bcsgn->bcgts", Ck, Bk)
    Bh = np.repeat(Bk, nheads // ngroups, axis=3)                                   # [b, c, K, h, N]
    xk = xp.reshape(batch, nc, K, nheads, P)
    segk = segp.reshape(batch, nc, K)
    S = np.zeros((batch, nheads, P, N)) if initial_states is None else initial_states.copy()
    states = np.zeros((batch, nc, nheads, P, N))
    prev = np.zeros(batch, np.int64)
    for c in range(nc):
        states[:, c] = S
        end = segk[:, c, -1]
        te = (segk[:, c] == end[:, None]).astype(np.float64)                         # [b, K]
        w = np.exp(cs[:, :, c, -1:] - cs[:, :, c]) * dt_out[:, :, c] * te[:, None]   # [b, h, K]
        chunk_state = np.einsum("bhs,bshp,bshn->bhpn", w, xk[:, c], Bh[:, c])
        carry = np.exp(cs[:, :, c, -1]) * (end == prev)[:, None]
        S = carry[:, :, None, None] * S + chunk_state
        prev = end
    return dt_out, cs, states, CB


CASES = {
    # name: dtype, (batch, seqlen, nheads, headdim, ngroups, dstate), chunk, options
    "plain_fp32": ("float32", (2, 37, 4, 40, 2, 40), 16, {}),  # headdim, dstate in 2 slices
    "all_options_fp32": ("float32", (2, 21, 4, 6, 1, 5), 8,
                         dict(D="head", z=True, dt_bias=True, initial_states=True, dfinal=True, seq_idx=True,
                              softplus=True, limit=(0.05, 1.0))),
    "channel_D_bf16": ("bfloat16", (2, 40, 8, 16, 1, 16), 16,
                       dict(D="channel", z=True, dt_bias=True, softplus=True, dfinal=True)),
    "seq_fp16": ("float16", (1, 33, 8, 8, 2, 4), 4, dict(seq_idx=True, initial_states=True, D="head")),
    "headdim_40_fp32": ("float32", (2, 19, 4, 40, 1, 16), 8, dict(D="channel", dt_bias=True, softplus=True)),
}


def _rand(shape, scale=1.0):
    return np.random.randn(*shape) * scale


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradients_match_float64_autograd(case):
    _check_case(case)


@pytest.mark.parametrize("case, tuning", [
    ("all_options_fp32", dict(fused_passing=(16, 32, 16, 4, 2))),
    ("plain_fp32", dict(fused_passing=(16, 32, 16, 4, 2))),
    ("channel_D_bf16", dict(states_lp=False)),
    ("seq_fp16", dict(fused_passing=(16, 16, 16, 4, 2), states_lp=False)),
    ("headdim_40_fp32", dict(dx=(16, 16, 16, 16, 4, 2, False, False))),
    ("all_options_fp32", dict(dx=(16, 16, 16, 16, 4, 2, True, True))),
    ("headdim_40_fp32", dict(dx=(16, 16, 16, 16, 4, 2, False, True)))])
def test_launch_variants_match_float64_autograd(case, tuning, monkeypatch):
    """The launch paths the defaults do not take at these sizes (``TUNING``): stages 3-4 as one kernel
    (headdim/dstate in several blocks), the chunk-state dC product on the fp32 states, headdim split
    over dx programs, dx programs ordered chunk first and walking the chunk's token blocks."""
    from paddlenlp_fused.kernels.triton import ssd_backward
    for key, value in tuning.items():
        monkeypatch.setitem(ssd_backward.TUNING, key, value)
    _check_case(case)


@pytest.mark.parametrize("case", ["channel_D_bf16", "seq_fp16"])
def test_states_in_x_dtype_match_float64_autograd(case):
    """The entering states in x's dtype, as the forward leaves them when stages 3+4 run fused
    (``ssd.states_dtype``): no fp32 copy to round, the d cs_end term on the rounded states."""
    _check_case(case, states_in_x_dtype=True)


def _check_case(case, states_in_x_dtype=False):
    dtype, (batch, seqlen, nheads, P, ngroups, N), K, opt = CASES[case]
    x = paddle.to_tensor(_rand((batch, seqlen, nheads, P))).astype(dtype)
    dt = paddle.to_tensor(_rand((batch, seqlen, nheads), 0.5) + (0.0 if opt.get("softplus") else 0.7)).astype(dtype)
    if not opt.get("softplus"):
        dt = paddle.abs(dt.astype("float32")).astype(dtype)  # positive without softplus
    A = paddle.to_tensor(-np.exp(_rand((nheads,), 0.5))).astype("float32")
    B = paddle.to_tensor(_rand((batch, seqlen, ngroups, N))).astype(dtype)
    C = paddle.to_tensor(_rand((batch, seqlen, ngroups, N))).astype(dtype)
    D = {None: None, "head": _rand((nheads,)), "channel": _rand((nheads, P))}[opt.get("D")]
    D = None if D is None else paddle.to_tensor(D).astype("float32")
    z = paddle.to_tensor(_rand((batch, seqlen, nheads, P))).astype(dtype) if opt.get("z") else None
    dt_bias = paddle.to_tensor(_rand((nheads,), 0.5)).astype("float32") if opt.get("dt_bias") else None
    init = paddle.to_tensor(_rand((batch, nheads, P, N))).astype("float32") if opt.get("initial_states") else None
    seq_idx = None
    if opt.get("seq_idx"):  # values alternate 0/1: runs, not values, define the sequences
        changes = np.random.rand(batch, seqlen) < 0.15
        changes[:, 0] = False
        seq_idx = paddle.to_tensor((np.cumsum(changes, axis=1) % 2).astype(np.int32))
    softplus, limit = bool(opt.get("softplus")), opt.get("limit", (0.0, math.inf))
    dout = paddle.to_tensor(_rand((batch, seqlen, nheads, P))).astype(dtype)
    dfinal = paddle.to_tensor(_rand((batch, nheads, P, N))).astype("float32") if opt.get("dfinal") else None

    # float64 reference and its gradients
    leaves = {name: paddle.to_tensor(to64(t), stop_gradient=False) for name, t in
              dict(x=x, dt=dt, A=A, B=B, C=C, D=D, z=z, dt_bias=dt_bias, initial_states=init).items() if t is not None}
    y64, final64 = ssd_chunked_ref(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], K,
                                   D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
                                   initial_states=leaves.get("initial_states"), seq_idx=seq_idx,
                                   dt_softplus=softplus, dt_limit=limit)
    loss = (y64 * paddle.to_tensor(to64(dout))).sum()
    if dfinal is not None:
        loss = loss + (final64 * paddle.to_tensor(to64(dfinal))).sum()
    names = sorted(leaves)
    ref_grads = dict(zip(names, paddle.grad(loss, [leaves[n] for n in names])))

    # forward intermediates (float64 math, saved as the forward saves them)
    n64 = {name: to64(t) for name, t in dict(x=x, dt=dt, A=A, B=B, C=C).items()}
    seg = None if seq_idx is None else segment_ids(seq_idx, batch, seqlen).numpy()
    dt_out, cs, states, CB = build_intermediates(
        n64["x"], n64["dt"], n64["A"], n64["B"], n64["C"], K, None if dt_bias is None else to64(dt_bias),
        None if init is None else to64(init), seg, softplus, limit)
    f32 = lambda a: paddle.to_tensor(a.astype(np.float32))  # noqa: E731
    out_x = None
    if z is not None:
        y_nogate, _ = ssd_chunked_ref(*(paddle.to_tensor(n64[k]) for k in "x dt A B C".split()), K,
                                      D=None if D is None else paddle.to_tensor(to64(D)),
                                      dt_bias=None if dt_bias is None else paddle.to_tensor(to64(dt_bias)),
                                      initial_states=None if init is None else paddle.to_tensor(to64(init)),
                                      seq_idx=seq_idx, dt_softplus=softplus, dt_limit=limit)
        out_x = y_nogate.astype(dtype)

    nan = lambda shape, dt_=dtype: paddle.full(shape, float("nan"), dtype=dt_)  # noqa: E731
    zeros = lambda shape: paddle.zeros(shape, dtype="float32")  # noqa: E731
    grads = dict(x=nan(x.shape), dt=nan(dt.shape), A=zeros([nheads]), B=zeros(B.shape), C=zeros(C.shape))
    if D is not None:
        grads["D"] = zeros(D.shape)
    if z is not None:
        grads["z"] = nan(z.shape)
    if dt_bias is not None:
        grads["dt_bias"] = zeros([nheads])
    if init is not None:
        grads["initial_states"] = nan(init.shape, "float32")
    ws = {name: paddle.full(list(shape), -7 if dt_ == "int32" else float("nan"), dtype=dt_) for name, (shape, dt_)
          in workspace_shapes(batch, seqlen, nheads, P, N, K, z is not None, dtype,
                              dtype if states_in_x_dtype else "float32").items()}
    ws_names = sorted(ws)
    order = ["dout", "x", "dt", "A", "B", "C", "dt_out", "cs", "states", "CB", "gx", "gdt", "gA", "gB", "gC",
             "D", "z", "out_x", "dt_bias", "init", "seq_idx", "dfinal", "gD", "gz", "gdt_bias", "ginit"]
    states = f32(states).astype(dtype) if states_in_x_dtype else f32(states)
    tensors = dict(dout=dout, x=x, dt=dt, A=A, B=B, C=C, dt_out=f32(dt_out), cs=f32(cs), states=states,
                   CB=f32(CB), gx=grads["x"], gdt=grads["dt"], gA=grads["A"], gB=grads["B"], gC=grads["C"], D=D, z=z,
                   out_x=out_x, dt_bias=dt_bias, init=init, seq_idx=seq_idx, dfinal=dfinal, gD=grads.get("D"),
                   gz=grads.get("z"), gdt_bias=grads.get("dt_bias"), ginit=grads.get("initial_states"))
    wrapped = triton_args(*[tensors[k] for k in order], *[ws[k] for k in ws_names])
    a = dict(zip(order + ["ws_" + k for k in ws_names], wrapped))
    ssd_chunked_bwd(a["dout"], a["x"], a["dt"], a["A"], a["B"], a["C"], a["dt_out"], a["cs"], a["states"], a["CB"],
                    a["gx"], a["gdt"], a["gA"], a["gB"], a["gC"], chunk_size=K, D=a["D"], z=a["z"], out_x=a["out_x"],
                    dt_bias=a["dt_bias"], initial_states=a["init"], seq_idx=a["seq_idx"], dfinal_states=a["dfinal"],
                    dD=a["gD"], dz=a["gz"], ddt_bias=a["gdt_bias"], dinitial_states=a["ginit"],
                    dt_softplus=softplus, dt_limit=limit, workspace={k: a["ws_" + k] for k in ws_names})

    assert set(grads) == set(ref_grads)
    failures = []
    # dA, ddt_bias and dD sum one term per token (and head / channel): their error is measured against the
    # sum of the terms' magnitudes (DESIGN), as their norm can be far smaller (cancellation; bf16 dA drew
    # 7.95e-3 against 7.81e-3 on a fresh seed). dA_h = sum_k dt_k r_k, r the in-chunk reverse cumsum of
    # d cs: the kernel's own d cs workspace serves for the scale.
    r = np.flip(np.cumsum(np.flip(to64(ws["ddA_cumsum"]), -1), -1), -1)
    term_scale = {"A": np.abs(dt_out * r).sum((0, 2, 3))}
    if dt_bias is not None:
        term_scale["dt_bias"] = np.abs(ref_grads["dt"].numpy()).sum((0, 1))
    if D is not None:
        dy_x = np.abs(n64["x"] * to64(dout) * (silu(to64(z)) if z is not None else 1.0))
        term_scale["D"] = dy_x.sum((0, 1, 3)) if D.ndim == 1 else dy_x.sum((0, 1))
    for name in names:
        # float32 inputs: fp32 accumulation of exact products; others: products in the input dtype
        check_dtype = dtype if name in ("x", "dt", "z") or dtype != "float32" else "float32"
        got, want = to64(grads[name]), ref_grads[name].numpy()
        try:
            if name in term_scale:
                assert_close_to_terms(f"d{name}", got, want, term_scale[name], check_dtype)
            else:
                assert_close(f"d{name}", got, want, check_dtype)
        except AssertionError as err:
            failures.append(str(err))
        print(name, rel_err(got, want))
    assert not failures, "; ".join(failures)


def test_bad_input_raises_clear_errors():
    x, dt, A = paddle.zeros([1, 8, 2, 4]), paddle.zeros([1, 8, 2]), paddle.zeros([2])
    cs, states, CB = paddle.zeros([1, 2, 2, 4]), paddle.zeros([1, 2, 2, 4, 4]), paddle.zeros([1, 2, 1, 4, 4])
    B3 = paddle.zeros([1, 8, 3, 4])  # 3 groups do not divide 2 heads
    with pytest.raises(ValueError, match="B: expected"):
        ssd_chunked_bwd(x, x, dt, A, B3, B3, cs, cs, states, CB, x, dt, A, B3, B3, chunk_size=4)
    B = paddle.zeros([1, 8, 1, 4])
    with pytest.raises(ValueError, match="workspace"):
        ssd_chunked_bwd(x, x, dt, A, B, B, cs, cs, states, CB, x, dt, A, B, B, chunk_size=4)
    with pytest.raises(TypeError, match="CB: expected float32"):
        ssd_chunked_bwd(x, x, dt, A, B, B, cs, cs, states, CB.astype("float64"), x, dt, A, B, B, chunk_size=4)
    with pytest.raises(ValueError, match="dt_out: expected shape"):
        ssd_chunked_bwd(x, x, dt, A, B, B, cs[:, :, :1], cs, states, CB, x, dt, A, B, B, chunk_size=4)
    with pytest.raises(ValueError, match="z, dz, out_x"):
        ssd_chunked_bwd(x, x, dt, A, B, B, cs, cs, states, CB, x, dt, A, B, B, chunk_size=4, z=x)


# ----------------------------------------------------------------------------------------------
# deterministic mode (issue #18): the Triton backward uses atomics, so the op takes the reference


def _op_inputs(batch=1, seqlen=16, nheads=2, headdim=4, ngroups=1, dstate=4):
    def leaf(shape, scale=1.0, offset=0.0):
        t = paddle.to_tensor((np.random.randn(*shape) * scale + offset).astype(np.float32))
        t.stop_gradient = False
        return t
    return dict(x=leaf((batch, seqlen, nheads, headdim)), dt=leaf((batch, seqlen, nheads), 0.5, -1.0),
                A=paddle.to_tensor(-np.exp(np.random.randn(nheads)).astype(np.float32)),
                B=leaf((batch, seqlen, ngroups, dstate)), C=leaf((batch, seqlen, ngroups, dstate)),
                chunk_size=16, D=leaf((nheads,)), dt_softplus=True)


def test_deterministic_routes_from_triton_to_the_reference(monkeypatch):
    """deterministic=True, and None under FLAGS_cudnn_deterministic, take the reference when a gradient
    can follow (False, the unset flag and a call under no_grad keep Triton); backend='triton' with it
    raises; auto on the GPU warns once, naming the cost; anything but None or a bool is a TypeError."""
    from paddlenlp_fused.ops import ssd as ssd_ops
    from paddlenlp_fused.runtime import backend as rb
    from paddlenlp_fused.runtime.backend import BackendUnavailableError

    chosen = []
    real = ssd_ops.choose_backend
    monkeypatch.setattr(ssd_ops, "choose_backend", lambda *a, **k: (chosen.append(real(*a, **k)), chosen[-1])[1])
    a = _op_inputs()
    want = ssd_chunked_ref(a["x"], a["dt"], a["A"], a["B"], a["C"], 16, D=a["D"], dt_softplus=True)[0]
    for deterministic, env in deterministic_settings(monkeypatch, ((True, None), (None, "1"), (False, "1"), (None, None))):
        y = ssd_ops.mamba_chunk_scan_combined(**a, deterministic=deterministic)
        if chosen[-1] == "reference":
            np.testing.assert_array_equal(y.numpy(), want.numpy())
    with paddle.no_grad():
        ssd_ops.mamba_chunk_scan_combined(**a, deterministic=True)
    assert chosen == ["reference", "reference", "triton", "triton", "triton"]
    with pytest.raises(BackendUnavailableError, match="'triton' does not support this call: deterministic"):
        ssd_ops.mamba_chunk_scan_combined(**a, backend="triton", deterministic=True)
    for bad in (1, "on"):
        with pytest.raises(TypeError, match="deterministic: expected None, True or False"):
            ssd_ops.mamba_chunk_scan_combined(**a, deterministic=bad)
    monkeypatch.setattr(rb, "_warned", set())
    monkeypatch.setattr(rb, "backend_status", lambda name, device: rb.BackendStatus(True, ""))
    with pytest.warns(RuntimeWarning, match=r"falling back to the reference backend \(triton: deterministic .*"
                                            r"pure Paddle autograd: slower"):
        assert rb.resolve_backend("mamba_chunk_scan_combined", "auto", "gpu", implemented=ssd_ops.IMPLEMENTED,
                                  unsupported=ssd_ops._triton_unsupported(16, True)) == "reference"


def test_mamba2_inner_path_passes_deterministic_on(monkeypatch):
    """mamba_split_conv1d_scan_combined hands deterministic to its conv and SSD, and refuses an explicit
    Triton SSD before the forward when a deterministic gradient is to be computed."""
    from paddlenlp_fused.ops import mamba2 as mamba2_ops
    from paddlenlp_fused.runtime.backend import BackendUnavailableError

    seen = []
    for name in ("causal_conv1d_fn", "mamba_chunk_scan_combined"):
        real = getattr(mamba2_ops, name)
        monkeypatch.setattr(mamba2_ops, name, lambda *a, _real=real, _name=name, **k: (
            seen.append((_name, k.get("deterministic"))), _real(*a, **k))[1])
    batch, seqlen, nheads, headdim, dstate = 1, 16, 2, 4, 4
    dim = nheads * headdim
    conv_dim = dim + 2 * dstate

    def leaf(shape, scale=1.0):
        t = paddle.to_tensor((np.random.randn(*shape) * scale).astype(np.float32))
        t.stop_gradient = False
        return t
    args = (leaf((batch, seqlen, 2 * dim + 2 * dstate + nheads)), leaf((conv_dim, 4), 0.5), leaf((conv_dim,)),
            leaf((nheads,)), paddle.to_tensor(-np.exp(np.random.randn(nheads)).astype(np.float32)), leaf((nheads,)), 16)
    mamba2_ops.mamba_split_conv1d_scan_combined(*args, headdim=headdim, backend="reference", deterministic=True)
    assert seen == [("causal_conv1d_fn", True), ("mamba_chunk_scan_combined", True)]
    with pytest.raises(BackendUnavailableError, match="'triton' does not support this call: deterministic"):
        mamba2_ops.mamba_split_conv1d_scan_combined(*args, headdim=headdim, backend="triton", deterministic=True)
