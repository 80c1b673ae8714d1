"""SSD backward launcher on the GPU: gradients against torch float64 autograd of a chunked SSD written
here (the math of ``reference/ssd.py``), outputs poisoned, fp32/fp16/bf16, odd shapes, every option,
64-bit offsets. The low-precision bound's baseline is the same torch composition run in that dtype;
dA and ddt_bias (per-head sums over all tokens), and in the one-token case every gradient of a short
inner product, are measured against the sum of their terms' magnitudes."""

import math

import pytest

from paddlenlp_fused.kernels.triton.ssd_backward import ssd_chunked_bwd, workspace_shapes
from paddlenlp_fused.testing.numerics import assert_close, assert_close_to_terms, rel_err

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _process_dt(dt, dt_bias, softplus, limit):
    v = dt if dt_bias is None else dt + dt_bias
    if softplus:
        v = F.softplus(v)
    lo, hi = limit
    if lo > 0.0 or hi < math.inf:
        v = v.clamp(lo, hi)
    return v


def ssd_torch(x, dt, A, B, C, K, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
              softplus=False, limit=(0.0, math.inf)):
    """Chunked SSD in the dtype of x (A, D, dt_bias, states cast to it). Returns y, final state and the
    forward intermediates (dt_out, dA_cumsum, states entering each chunk, CB, y before the gate)."""
    cdt = x.dtype
    batch, seqlen, nheads, P = x.shape
    ngroups, N = B.shape[2], B.shape[3]
    nc = -(-seqlen // K)
    pad = nc * K - seqlen
    dtp = _process_dt(dt, None if dt_bias is None else dt_bias.to(cdt), softplus, limit)
    padT = lambda t: F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad))  # noqa: E731  pad the token axis (1)
    xp, dtp, Bp, Cp = padT(x), padT(dtp), padT(B), padT(C)
    if seq_idx is None:
        seg = torch.zeros(batch, nc * K, dtype=torch.long, device=x.device)
    else:
        seg = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=x.device),
                         (seq_idx[:, 1:] != seq_idx[:, :-1]).long().cumsum(1)], 1)
        seg = torch.cat([seg, seg[:, -1:].expand(batch, pad)], 1)
    hpg = nheads // ngroups
    xk = xp.reshape(batch, nc, K, nheads, P).permute(0, 1, 3, 2, 4)
    Bk = Bp.reshape(batch, nc, K, ngroups, N)
    Ck = Cp.reshape(batch, nc, K, ngroups, N)
    Bh = Bk.repeat_interleave(hpg, 3).permute(0, 1, 3, 2, 4)
    Ch = Ck.repeat_interleave(hpg, 3).permute(0, 1, 3, 2, 4)
    dtk = dtp.reshape(batch, nc, K, nheads).permute(0, 1, 3, 2)                    # [b, c, h, K]
    cs = torch.cumsum(dtk * A.to(cdt)[:, None], -1)
    segk = seg.reshape(batch, nc, K)
    prev = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=x.device), segk[:, :-1, -1]], 1)
    causal = torch.ones(K, K, dtype=torch.bool, device=x.device).tril()
    causal = causal & (segk[:, :, :, None] == segk[:, :, None, :])[:, :, None]
    decay = torch.exp(torch.where(causal, cs[..., :, None] - cs[..., None, :], -math.inf))
    y = ((Ch @ Bh.transpose(-1, -2)) * decay * dtk[..., None, :]) @ xk
    to_end = torch.where((segk == segk[:, :, -1:])[:, :, None], cs[..., -1:] - cs, -math.inf)
    chunk_states = (xk * (torch.exp(to_end) * dtk)[..., None]).transpose(-1, -2) @ Bh
    h = initial_states.to(cdt) if initial_states is not None else x.new_zeros(batch, nheads, P, N)
    starts = []
    for c in range(nc):
        starts.append(h)
        carry = torch.exp(cs[:, c, :, -1]) * (segk[:, c, -1] == prev[:, c]).to(cdt)[:, None]
        h = carry[:, :, None, None] * h + chunk_states[:, c]
    h_start = torch.stack(starts, 1)
    from_start = torch.where((segk == prev[:, :, None])[:, :, None], cs, -math.inf)
    y = y + (Ch @ h_start.transpose(-1, -2)) * torch.exp(from_start)[..., None]
    y = y.permute(0, 1, 3, 2, 4).reshape(batch, nc * K, nheads, P)[:, :seqlen]
    if D is not None:
        y = y + (D.to(cdt)[:, None] if D.ndim == 1 else D.to(cdt)) * x
    out_x = y
    if z is not None:
        y = y * F.silu(z)
    inter = dict(dt_out=dtk.permute(0, 2, 1, 3), cs=cs.permute(0, 2, 1, 3), states=h_start, dtk=dtk,
                 cs_chunk_major=cs, CB=torch.einsum("bctgn,bcsgn->bcgts", Ck, Bk), out_x=out_x)
    return y, h, inter


def _grads(fn_dtype, inputs, K, opts, dout, dfinal):
    """Autograd of ssd_torch with every input cast to fn_dtype; also returns the intermediates and the
    gradient of dA_cumsum [b, c, h, K] (for the terms of dA)."""
    leaves = {k: v.detach().to(fn_dtype).requires_grad_(True) for k, v in inputs.items()}
    y, final, inter = ssd_torch(leaves["x"], leaves["dt"], leaves["A"], leaves["B"], leaves["C"], K,
                                D=leaves.get("D"), z=leaves.get("z"), dt_bias=leaves.get("dt_bias"),
                                initial_states=leaves.get("initial_states"), **opts)
    loss = (y * dout.to(fn_dtype)).sum()
    if dfinal is not None:
        loss = loss + (final * dfinal.to(fn_dtype)).sum()
    names = sorted(leaves)
    grads = torch.autograd.grad(loss, [leaves[n] for n in names] + [inter["cs_chunk_major"]])
    return dict(zip(names, grads[:-1])), inter, grads[-1]


def run_case(provider, dtype, dims, K, opt, check=True, states_in_x_dtype=False):
    batch, seqlen, nheads, P, ngroups, N = dims
    dev = provider.device
    td = getattr(torch, dtype)
    r = lambda *s, scale=1.0: torch.randn(*s, device=dev, dtype=torch.float64) * scale  # noqa: E731
    inputs = dict(x=r(batch, seqlen, nheads, P), B=r(batch, seqlen, ngroups, N), C=r(batch, seqlen, ngroups, N),
                  A=-torch.exp(r(nheads, scale=0.5)))
    inputs["dt"] = r(batch, seqlen, nheads, scale=0.5) if opt.get("softplus") else r(batch, seqlen, nheads).abs() * 0.3
    if opt.get("D") == "head":
        inputs["D"] = r(nheads)
    elif opt.get("D") == "channel":
        inputs["D"] = r(nheads, P)
    if opt.get("z"):
        inputs["z"] = r(batch, seqlen, nheads, P)
    if opt.get("dt_bias"):
        inputs["dt_bias"] = r(nheads, scale=0.5)
    if opt.get("initial_states"):
        inputs["initial_states"] = r(batch, nheads, P, N)
    # x-like inputs in the dtype; A, D, dt_bias, initial_states stay fp32 (as a model keeps them)
    cast = {k: v.to(td if k in ("x", "dt", "B", "C", "z") else torch.float32) for k, v in inputs.items()}
    inputs64 = {k: v.double() for k, v in cast.items()}
    seq_idx = None
    if opt.get("seq_idx"):
        changes = torch.rand(batch, seqlen, device=dev) < opt.get("seq_rate", 0.02)
        changes[:, 0] = False
        seq_idx = (changes.long().cumsum(1) % 3).to(torch.int32)
    opts = dict(seq_idx=seq_idx, softplus=bool(opt.get("softplus")), limit=opt.get("limit", (0.0, math.inf)))
    dout = r(batch, seqlen, nheads, P).to(td)
    dfinal = r(batch, nheads, P, N).float() if opt.get("dfinal") else None

    ref, inter, dcs = _grads(torch.float64, inputs64, K, opts, dout, dfinal)
    low, _, _ = _grads(td, cast, K, opts, dout, dfinal)  # the plain torch computation in this dtype
    # dA and ddt_bias sum one term per token and head: dA_h = sum dt_k * (sum_{t>=k in chunk} dcs_t),
    # ddt_bias_h = sum ddt. Their error is measured against the sum of the terms' magnitudes (the
    # forward-error measure of a sum); their norm is often much smaller (cancellation).
    term_scale = {"A": (inter["dtk"].detach() * dcs.flip(-1).cumsum(-1).flip(-1)).abs().sum((0, 1, 3))}
    if "dt_bias" in ref:
        term_scale["dt_bias"] = ref["dt"].abs().sum((0, 1))
    if opt.get("one_token"):
        # one token: every gradient is a short inner product (C.B, <dout silu(z), x>) times factors, so
        # its cancellation, not the kernels, sets the relative error (torch in the dtype draws 2e-2 too).
        # The measure is then the terms' magnitudes: the polynomial at |inputs| with |dout silu(z)| as
        # the cotangent (the decay of the token to itself is 1; no initial state, so A does not enter)
        mags = {k: v.abs() for k, v in inputs64.items() if k != "z"}
        cot = (dout.double() * F.silu(inputs64["z"])).abs() if "z" in inputs64 else dout.double().abs()
        abs_grads, _, _ = _grads(torch.float64, mags, K, opts, cot, None)
        term_scale.update({k: abs_grads[k] for k in ("x", "dt", "B", "C", "D") if k in abs_grads})
    nan = lambda t, d=None: torch.full_like(t, float("nan"), dtype=d or t.dtype)  # noqa: E731
    g = dict(x=nan(cast["x"]), dt=nan(cast["dt"]), A=torch.zeros(nheads, device=dev),
             B=torch.zeros_like(cast["B"], dtype=torch.float32), C=torch.zeros_like(cast["C"], dtype=torch.float32))
    for k in ("D", "dt_bias"):
        if k in cast:
            g[k] = torch.zeros_like(cast[k])
    if "z" in cast:
        g["z"] = nan(cast["z"])
    if "initial_states" in cast:
        g["initial_states"] = nan(cast["initial_states"])
    ws = {k: torch.full(s, float("nan"), device=dev, dtype=getattr(torch, d)) if d != "int32" else
          torch.full(s, -7, device=dev, dtype=torch.int32)
          for k, (s, d) in workspace_shapes(batch, seqlen, nheads, P, N, K, "z" in cast, dtype,
                                            dtype if states_in_x_dtype else "float32").items()}
    f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
    ssd_chunked_bwd(dout, cast["x"], cast["dt"], cast["A"], cast["B"], cast["C"], f32(inter["dt_out"]),
                    f32(inter["cs"]), f32(inter["states"]).to(td if states_in_x_dtype else torch.float32),
                    f32(inter["CB"]), g["x"], g["dt"], g["A"], g["B"], g["C"],
                    chunk_size=K, D=cast.get("D"), z=cast.get("z"),
                    out_x=inter["out_x"].detach().to(td).contiguous() if "z" in cast else None,
                    dt_bias=cast.get("dt_bias"), initial_states=cast.get("initial_states"), seq_idx=seq_idx,
                    dfinal_states=dfinal, dD=g.get("D"), dz=g.get("z"), ddt_bias=g.get("dt_bias"),
                    dinitial_states=g.get("initial_states"), dt_softplus=opts["softplus"], dt_limit=opts["limit"],
                    workspace=ws)
    provider.synchronize()
    errors, bases, failures = {}, {}, []
    for name in sorted(ref):
        want = ref[name].cpu().numpy()
        base = bases[name] = rel_err(low[name].double().cpu().numpy(), want)
        errors[name] = rel_err(g[name].double().cpu().numpy(), want)
        if check:
            try:
                if name in term_scale:
                    errors[name + "/terms"] = assert_close_to_terms(
                        f"d{name}", g[name].double().cpu().numpy(), want, term_scale[name].detach().cpu().numpy(),
                        dtype)
                else:
                    assert_close(f"d{name}", g[name].double().cpu().numpy(), want, dtype, baseline_err=base)
            except AssertionError as err:
                failures.append(f"{err} (torch {dtype}: {base:.2e})")
    print(f"{dtype} {dims} K={K} {sorted(opt)}: " + " ".join(f"d{k}={v:.2e}" for k, v in errors.items()) +
          f" | torch {dtype}: " + " ".join(f"d{k}={v:.1e}" for k, v in bases.items()))
    assert not failures, "; ".join(failures)
    return errors


ALL = dict(D="channel", z=True, dt_bias=True, initial_states=True, dfinal=True, seq_idx=True, softplus=True,
           limit=(0.02, 2.0))
CASES = [
    # (batch, seqlen, nheads, headdim, ngroups, dstate), chunk, options
    ((2, 300, 4, 64, 1, 64), 64, {}),
    ((1, 1, 1, 32, 1, 16), 16, dict(D="head", z=True, one_token=True)),  # one token, one head
    ((1, 1000, 6, 80, 2, 40), 128, ALL),
    ((2, 517, 8, 64, 1, 128), 256, dict(D="head", z=True, dt_bias=True, softplus=True, dfinal=True)),
]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_gradients_match_float64(provider, case, dtype):
    dims, K, opt = CASES[case]
    run_case(provider, dtype, dims, K, opt)


VARIANTS = {"fused": dict(fused_passing=(32, 32, 32, 4, 2)), "fp32_states": dict(states_lp=False),
            "fused_fp32_states": dict(fused_passing=(32, 32, 32, 4, 2), states_lp=False),
            "split_p": dict(dx=(64, 64, 64, 32, 4, 2, False, False)),
            "dx_token_loop": dict(dx=(64, 32, 128, 128, 8, 3, True, True))}


@pytest.mark.parametrize("variant, dtype", [("fused", "float32"), ("fused", "bfloat16"), ("fp32_states", "bfloat16"),
                                            ("fused_fp32_states", "float16"), ("split_p", "bfloat16"),
                                            ("split_p", "float32"), ("dx_token_loop", "bfloat16"),
                                            ("dx_token_loop", "float32")])
def test_launch_variants(provider, variant, dtype, monkeypatch):
    """The launch paths the defaults do not take at these sizes (``TUNING``): stages 3-4 as one kernel
    (headdim/dstate in several blocks), the chunk-state dC product on the fp32 states, headdim split
    over dx programs (chunk-first order), dx programs walking the chunk's token blocks; every option."""
    from paddlenlp_fused.kernels.triton import ssd_backward
    for key, value in VARIANTS[variant].items():
        monkeypatch.setitem(ssd_backward.TUNING, key, value)
    run_case(provider, dtype, (1, 1000, 6, 80, 2, 40), 128, ALL)
    run_case(provider, dtype, (2, 517, 8, 64, 1, 128), 256, dict(D="head", dfinal=True, softplus=True))


@pytest.mark.parametrize("states_in_x_dtype", [False, True])
def test_benchmark_layout_bf16(provider, states_in_x_dtype):
    """The benchmark's head layout (headdim 128, dstate 128, chunk 256, 1 group) on a shorter sequence,
    with fp32 entering states or bf16 ones (as the fused forward leaves them: ``ssd.states_dtype``)."""
    run_case(provider, "bfloat16", (1, 1024, 16, 128, 1, 128), 256, dict(D="head", z=True, seq_idx=True,
                                                                          seq_rate=0.002),
             states_in_x_dtype=states_in_x_dtype)


@pytest.mark.xdist_group("huge")
def test_offsets_past_2_31(provider):
    """x has more than 2^31 elements: the last chunk's gradients (which depend only on that chunk and
    the state entering it, with no final-state gradient) against float64 on that chunk alone."""
    nheads, P, N, K, ngroups = 32, 128, 16, 64, 1
    seqlen = 2**31 // (nheads * P) + 2 * K + 5
    dev = provider.device
    bf = torch.bfloat16
    x = torch.randn(1, seqlen, nheads, P, device=dev, dtype=bf)
    dout = torch.randn_like(x)
    dt = (torch.rand(1, seqlen, nheads, device=dev) * 0.3).to(bf)
    A = -torch.rand(nheads, device=dev) - 0.2
    B = torch.randn(1, seqlen, ngroups, N, device=dev, dtype=bf)
    C = torch.randn(1, seqlen, ngroups, N, device=dev, dtype=bf)
    nc = -(-seqlen // K)
    pad = nc * K - seqlen
    dt_out = F.pad(dt.float(), (0, 0, 0, pad)).reshape(1, nc, K, nheads).permute(0, 3, 1, 2).contiguous()
    cs = torch.cumsum(dt_out * A[None, :, None, None], -1).contiguous()
    states = torch.randn(1, nc, nheads, P, N, device=dev)
    Bp = F.pad(B.float(), (0, 0, 0, 0, 0, pad)).reshape(1, nc, K, ngroups, N)
    Cp = F.pad(C.float(), (0, 0, 0, 0, 0, pad)).reshape(1, nc, K, ngroups, N)
    CB = torch.einsum("bctgn,bcsgn->bcgts", Cp, Bp).contiguous()
    del Bp, Cp
    g = dict(x=torch.full_like(x, float("nan")), dt=torch.full_like(dt, float("nan")),
             A=torch.zeros(nheads, device=dev), B=torch.zeros_like(B, dtype=torch.float32),
             C=torch.zeros_like(C, dtype=torch.float32))
    ws = {k: torch.empty(s, device=dev, dtype=getattr(torch, d))
          for k, (s, d) in workspace_shapes(1, seqlen, nheads, P, N, K, False, "bfloat16").items()}
    ssd_chunked_bwd(dout, x, dt, A, B, C, dt_out, cs, states, CB, g["x"], g["dt"], g["A"], g["B"], g["C"],
                    chunk_size=K, workspace=ws)
    provider.synchronize()
    start = (nc - 1) * K
    tail = lambda t: t[:, start:].double().requires_grad_(True)  # noqa: E731
    xt, dtt, Bt, Ct = tail(x), tail(dt), tail(B), tail(C)
    y, _, _ = ssd_torch(xt, dtt, A.double(), Bt, Ct, K, initial_states=states[:, -1].double())
    want = torch.autograd.grad((y * dout[:, start:].double()).sum(), [xt, dtt, Bt, Ct])
    for name, got, ref in zip(("dx", "ddt", "dB", "dC"), (g["x"], g["dt"], g["B"], g["C"]), want):
        assert_close(f"tail {name}", got[:, start:].double().cpu().numpy(), ref.cpu().numpy(), "bfloat16")
    assert not torch.isnan(g["x"]).any() and not torch.isnan(g["dt"]).any()
