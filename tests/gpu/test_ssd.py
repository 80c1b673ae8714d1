"""Mamba-2 SSD forward kernels on the GPU against float64: the chunked algorithm written here in torch
float64 (itself checked against the token-by-token recurrence), poisoned outputs, every option, every
dtype, odd shapes, seqlen 32768 and a tensor past 2^31 elements.

Besides y and final_states, the buffers the backward reads (dt_out, dA_cumsum, entering states, CB,
out_x) are checked against their float64 counterparts, so the layout contract holds on the device."""

import math

import numpy as np
import pytest

from paddlenlp_fused.kernels.triton import ssd as K
from paddlenlp_fused.testing.numerics import assert_close, rel_err

torch = pytest.importorskip("torch")
F = torch.nn.functional


def _inputs(provider, batch, seqlen, nheads, headdim, ngroups, dstate, dtype, opts):
    x = provider.randn((batch, seqlen, nheads, headdim), dtype)
    dt = provider.randn((batch, seqlen, nheads), dtype, scale=0.5, offset=-1.0 if opts.get("softplus") else 0.0)
    if not opts.get("softplus"):
        dt = dt.abs() + 0.01  # positive step sizes without softplus
    A = provider.from_numpy(-np.exp(np.random.randn(nheads) * 0.5), "float32")
    B = provider.randn((batch, seqlen, ngroups, dstate), dtype)
    C = provider.randn((batch, seqlen, ngroups, dstate), dtype)
    a = dict(x=x, dt=dt, A=A, B=B, C=C)
    if opts.get("D") == "heads":
        a["D"] = provider.randn((nheads,), "float32")
    elif opts.get("D") == "headdim":
        a["D"] = provider.randn((nheads, headdim), "float32")
    if opts.get("z"):
        a["z"] = provider.randn(x.shape, dtype)
    if opts.get("bias"):
        a["dt_bias"] = provider.randn((nheads,), "float32", scale=0.3)
    if opts.get("init"):
        a["initial_states"] = provider.randn((batch, nheads, headdim, dstate), "float32")
    if opts.get("seq"):  # run ids: random run lengths, so runs start inside and at the edges of chunks
        ids = np.zeros((batch, seqlen), np.int64)
        for row in range(batch):
            cuts = np.sort(np.random.choice(np.arange(1, seqlen), size=min(opts["seq"], seqlen - 1), replace=False))
            ids[row] = np.searchsorted(cuts, np.arange(seqlen), side="right")
        a["seq_idx"] = provider.from_numpy(ids, "int32")
    return a


def chunked64(x, dt, A, B, C, chunk, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
              dt_softplus=False, dt_limit=(0.0, math.inf)):
    """The SSD chunked algorithm in torch float64: (y, out_x, final, dt_out, dA_cumsum, states, CB)."""
    f = lambda t: None if t is None else t.to(torch.float64)  # noqa: E731
    x, dt, A, B, C, D, z, dt_bias, init = (f(t) for t in (x, dt, A, B, C, D, z, dt_bias, initial_states))
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    nc = -(-seqlen // chunk)
    pad = nc * chunk - seqlen
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(dt_limit[0], dt_limit[1])
    padded = lambda t: F.pad(t, (0, 0) * (t.ndim - 2) + (0, pad))  # noqa: E731
    xk = padded(x).reshape(batch, nc, chunk, nheads, headdim)
    dtk = padded(dt).reshape(batch, nc, chunk, nheads).permute(0, 3, 1, 2)             # [b, h, c, K]
    Bk = padded(B).reshape(batch, nc, chunk, ngroups, dstate)
    Ck = padded(C).reshape(batch, nc, chunk, ngroups, dstate)
    cs = torch.cumsum(dtk * A[None, :, None, None], dim=-1)                            # [b, h, c, K]
    CB = torch.einsum("bctgn,bcsgn->bcgts", Ck, Bk)                                     # [b, c, g, K, K]
    rep = nheads // ngroups
    CBh = CB.repeat_interleave(rep, dim=2).permute(0, 2, 1, 3, 4)                      # [b, h, c, K, K]
    if seq_idx is not None:
        seg = seq_idx.to(torch.int64)
        seg = torch.cat([seg, seg[:, -1:].expand(batch, pad)], dim=1).reshape(batch, nc, chunk)
        prev = torch.cat([seg[:, :1, 0], seg[:, :-1, -1]], dim=1)                        # [b, c]
        same = (seg[:, :, :, None] == seg[:, :, None, :])[:, None]                       # [b, 1, c, K, K]
        end_run = (seg == seg[:, :, -1:])[:, None]                                       # [b, 1, c, K]
        enter_run = (seg == prev[:, :, None])[:, None]
        carry_ok = (seg[:, :, -1] == prev)[:, None]                                      # [b, 1, c]
    else:
        same = end_run = enter_run = carry_ok = torch.ones((), dtype=torch.bool, device=x.device)
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=x.device)) & same
    decay = torch.exp(torch.where(causal, cs[..., :, None] - cs[..., None, :], -math.inf))
    scores = CBh * decay * dtk[..., None, :]                                             # [b, h, c, t, s]
    y = torch.einsum("bhcts,bcshp->bcthp", scores, xk)
    w = torch.exp(torch.where(end_run, cs[..., -1:] - cs, -math.inf)) * dtk              # [b, h, c, K]
    Bh = Bk.repeat_interleave(rep, dim=3)
    own = torch.einsum("bhcs,bcshp,bcshn->bchpn", w, xk, Bh)
    carry = torch.exp(cs[..., -1]) * carry_ok                                            # [b, h, c]
    h = init if init is not None else x.new_zeros(batch, nheads, headdim, dstate)
    states = []
    for c in range(nc):
        states.append(h)
        h = carry[:, :, c, None, None] * h + own[:, c]
    states = torch.stack(states, dim=1)
    from_start = torch.exp(torch.where(enter_run, cs, -math.inf))                         # [b, h, c, K]
    Ch = Ck.repeat_interleave(rep, dim=3)
    y = y + torch.einsum("bcthn,bchpn,bhct->bcthp", Ch, states, from_start)
    y = y.reshape(batch, nc * chunk, nheads, headdim)[:, :seqlen]
    if D is not None:
        y = y + (D[:, None] if D.ndim == 1 else D) * x
    out_x = y
    if z is not None:
        y = y * F.silu(z)
    return y, out_x, h, dtk, cs, states, CB


def recurrence64(x, dt, A, B, C, dt_softplus=False):
    """Token-by-token float64 recurrence (no D/z/bias/seq): y, final state."""
    x, dt, A, B, C = (t.to(torch.float64) for t in (x, dt, A, B, C))
    if dt_softplus:
        dt = F.softplus(dt)
    rep = x.shape[2] // B.shape[2]
    Bh, Ch = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    h = x.new_zeros(x.shape[0], x.shape[2], x.shape[3], B.shape[3])
    ys = []
    for t in range(x.shape[1]):
        h = torch.exp(dt[:, t] * A)[..., None, None] * h + (dt[:, t, :, None] * x[:, t])[..., None] * Bh[:, t, :, None]
        ys.append(torch.einsum("bhpn,bhn->bhp", h, Ch[:, t]))
    return torch.stack(ys, dim=1), h


def _run(provider, a, chunk, softplus=False, limit=(0.0, math.inf), config=None):
    x = a["x"]
    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = a["B"].shape[2:]
    dtype = str(x.dtype).split(".")[-1]
    # the states in x's dtype where the kernels allow it (stages 3+4 fused, 16-bit x), as the op passes them
    states_dtype = K.states_dtype(dtype, batch, nheads, config)
    buf = {k: provider.poisoned(v, states_dtype if k == "states" else "float32") for k, v in
           K.buffer_shapes(batch, seqlen, nheads, headdim, ngroups, dstate, chunk).items()}
    out = provider.poisoned(x.shape, dtype)
    out_x = provider.poisoned(x.shape, dtype) if "z" in a else None
    K.ssd_chunked_fwd(x, a["dt"], a["A"], a["B"], a["C"], out, buf["dt_out"], buf["dA_cumsum"], buf["states"],
                      buf["CB"], buf["final_states"], chunk_size=chunk, D=a.get("D"), z=a.get("z"), out_x=out_x,
                      dt_bias=a.get("dt_bias"), initial_states=a.get("initial_states"), seq_idx=a.get("seq_idx"),
                      dt_softplus=softplus, dt_limit=limit, config=config)
    provider.synchronize()
    return out, out_x, buf


CASES = {  # (batch, seqlen, nheads, headdim, ngroups, dstate, chunk), options
    "canonical_small": ((2, 1024, 4, 128, 1, 128, 256), dict(D="heads")),
    "all_options_ragged": ((2, 333, 6, 40, 3, 24, 64), dict(D="headdim", z=True, bias=True, softplus=True,
                                                           limit=(0.01, 2.0), init=True, seq=7)),
    "seqlen_1": ((3, 1, 2, 16, 2, 16, 16), dict(D="heads", z=True, init=True)),
    "odd_small": ((1, 77, 4, 7, 4, 5, 16), dict(bias=True, softplus=True, seq=5)),
    "chunk_128_headdim_64": ((2, 700, 8, 64, 2, 64, 128), dict(z=True, softplus=True, init=True)),
    "autotuned": ((1, 8192 - 77, 64, 64, 4, 64, 256), dict(D="heads", z=True, softplus=True, seq=9, init=True)),
    "autotuned_fused": ((2, 4096 - 77, 64, 64, 2, 64, 256), dict(D="headdim", softplus=True, seq=5, init=True)),
}


VARIANTS = {  # SSDConfig options on top of the defaults
    "": {},
    "fused": dict(fuse_state_passing=True),
    "recompute_cb": dict(recompute_cb=True, scan_m_loop=False, scan_heads_first=False, split_scores=False),
    "recompute_m_loop": dict(recompute_cb=True),
    "load_cb_per_tile": dict(scan_m_loop=False),
}


FORWARD_CASES = [  # every dtype, but the autotuned path (compiled for every config) in bf16 only
    (case, dtype) for case in list(CASES) + [f"{name}:{v}" for v in list(VARIANTS)[1:]
                                             for name in ("all_options_ragged", "canonical_small")]
    for dtype in ("float32", "float16", "bfloat16") if dtype == "bfloat16" or not case.startswith("autotuned")]


@pytest.mark.parametrize("case,dtype", FORWARD_CASES)
def test_forward_and_saved_buffers_match_float64(provider, case, dtype):
    """Variants (``VARIANTS``): the defaults (stages 3 and 4 apart at these sizes; the chunk scan
    loading CB, walking its chunk's token tiles), ``:fused`` stages 3 and 4 in one kernel,
    ``:recompute_cb`` the chunk scan recomputing C.B blocks one token tile per program (bf16 scores
    as two terms), ``:recompute_m_loop``, ``:load_cb_per_tile``. ``autotuned*``: no config and enough
    programs (TUNE_MIN_PROGRAMS) for the autotuned kernels (``_fused``: batch * nheads reaches
    FUSED_MIN_ROWS, so stages 3 and 4 run fused)."""
    name, _, variant = case.partition(":")
    dims, opts = CASES[name]
    batch, seqlen, nheads, headdim, ngroups, dstate, chunk = dims
    a = _inputs(provider, batch, seqlen, nheads, headdim, ngroups, dstate, dtype, opts)
    limit = opts.get("limit", (0.0, math.inf))
    config = None if name.startswith("autotuned") else K.SSDConfig(**VARIANTS[variant])
    out, out_x, buf = _run(provider, a, chunk, opts.get("softplus", False), limit, config)
    y64, outx64, final64, dt64, cs64, states64, CB64 = chunked64(
        **a, chunk=chunk, dt_softplus=opts.get("softplus", False), dt_limit=limit)
    # fp32 inputs run IEEE fp32 products; 16-bit inputs round the decay-weighted operands to the dtype
    check = lambda name, t, ref, dt_=dtype: assert_close(name, provider.to_numpy(t), ref.cpu().numpy(), dt_)  # noqa
    check("y", out, y64)
    if out_x is not None:
        check("out_x", out_x, outx64)
    check("final_states", buf["final_states"], final64)
    check("states", buf["states"], states64)
    check("dt_out", buf["dt_out"], dt64, "float32")
    check("dA_cumsum", buf["dA_cumsum"], cs64, "float32")
    check("CB", buf["CB"], CB64, "float32")  # products of the same 16-bit values, exact in fp32
    if name == "autotuned_fused":
        assert K.tuned_configs()["fused_states"], "stages 3 and 4 ran fused and autotuned"


def test_chunked64_equals_recurrence(provider):
    """The float64 chunked algorithm above is itself the recurrence (ragged chunk, 2 groups)."""
    a = _inputs(provider, 2, 45, 4, 8, 2, 6, "float32", dict(softplus=True))
    y, _, final, *_ = chunked64(**a, chunk=16, dt_softplus=True)
    y_rec, final_rec = recurrence64(**a, dt_softplus=True)
    assert rel_err(y.cpu().numpy(), y_rec.cpu().numpy()) < 1e-12
    assert rel_err(final.cpu().numpy(), final_rec.cpu().numpy()) < 1e-12


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_states_at_positions(provider, dtype):
    """The state after chosen tokens (per-sequence final states of a packed row) equals the float64
    state of the prefix ending there."""
    seqlen, chunk = 300, 64
    a = _inputs(provider, 1, seqlen, 4, 32, 2, 16, dtype, dict(softplus=True, init=True, seq=6))
    _, _, buf = _run(provider, a, chunk, True)
    ids = provider.to_numpy(a["seq_idx"])[0]
    positions = np.concatenate([np.flatnonzero(np.diff(ids)), [seqlen - 1, 0, 63, 64, 100]]).astype(np.int64)
    pos = provider.from_numpy(positions, "int64")
    at = provider.poisoned((1, len(positions), 4, 32, 16), "float32")
    K.ssd_states_at(a["x"], a["dt"], a["A"], a["B"], buf["dt_out"], buf["dA_cumsum"], buf["states"], pos, at,
                    chunk_size=chunk, seq_idx=a["seq_idx"])
    provider.synchronize()
    for i, p in enumerate(positions):
        prefix = {k: (v[:, :p + 1] if k in ("x", "dt", "B", "C", "seq_idx") else v) for k, v in a.items()}
        _, _, final64, *_ = chunked64(**prefix, chunk=chunk, dt_softplus=True)
        assert_close(f"state after token {p}", provider.to_numpy(at[:, i]), final64.cpu().numpy(), dtype)


def test_seqlen_32768(provider):
    a = _inputs(provider, 1, 32768, 4, 64, 1, 64, "bfloat16", dict(D="heads", softplus=True, bias=True))
    out, _, buf = _run(provider, a, 256, True)
    y64, _, final64, *_ = chunked64(**a, chunk=256, dt_softplus=True)
    assert_close("y", provider.to_numpy(out), y64.cpu().numpy(), "bfloat16")
    assert_close("final_states", provider.to_numpy(buf["final_states"]), final64.cpu().numpy(), "bfloat16")


@pytest.mark.xdist_group("huge")
def test_past_2_31_elements(provider):
    """x [1, 32768, 520, 128] bf16 has more than 2^31 elements (states [1, 128, 520, 128, 128] fp32,
    4.4 GB): 64-bit offsets; the last head (independent of the others) is checked against float64."""
    batch, seqlen, nheads, headdim, dstate, chunk = 1, 32768, 520, 128, 128, 256
    a = _inputs(provider, batch, seqlen, nheads, headdim, 1, dstate, "bfloat16", dict(softplus=True))
    out, _, buf = _run(provider, a, chunk, True)
    last = {"x": a["x"][:, :, -1:], "dt": a["dt"][:, :, -1:], "A": a["A"][-1:], "B": a["B"], "C": a["C"]}
    y64, _, final64, *_ = chunked64(**last, chunk=chunk, dt_softplus=True)
    assert_close("y (last head)", provider.to_numpy(out[:, :, -1:]), y64.cpu().numpy(), "bfloat16")
    assert K.tuned_configs()["chunk_scan"], "the autotuned kernels ran"
    assert_close("final (last head)", provider.to_numpy(buf["final_states"][:, -1:]), final64.cpu().numpy(),
                 "bfloat16")


def test_bad_chunk_size_raises(provider):
    a = _inputs(provider, 1, 40, 2, 16, 1, 16, "float32", {})
    for bad in (8, 48):
        with pytest.raises(ValueError, match="chunk_size"):
            _run(provider, a, bad)
