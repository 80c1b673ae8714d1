"""Mamba-1 selective scan fwd / fwd+bwd (PERFORMANCE.md): u, delta, z [8, 4096, 2048] bf16, dstate 16,
input-dependent B/C [8, 16, 2048] bf16, D and delta_bias fp32, softplus. Our Triton kernels against
the torch composition (mamba_ssm's sequential ``selective_scan_ref``) in the same process.

The torch composition runs a Python loop over seqlen (~160 ms per batch element forward on an
H200), so it is timed on batch 1 and reported per batch element next to ours (``*_per_batch_ms``);
``speedup_vs_torch`` compares those. ``sweep`` times other dim blocks of the forward and backward
kernels (the defaults are picked from it).

Bytes (bf16): forward reads u, delta, z, B, C and writes out; the backward reads u, delta, z, B, C,
dout (twice the delta) and writes du, ddelta, dz (plus fp32 atomics into dB, dC).
"""

from __future__ import annotations

import numpy as np
from common import GiB, TBps, bench_ms, peak_GiB

from paddlenlp_fused.kernels.triton import selective_scan as K
from paddlenlp_fused.testing.numerics import rel_err

CHECK_DIMS = 64  # dims of batch 0 checked against float64 (a sequential numpy loop)


def _reference64(u, delta, A, B, C, D, z, bias):
    """float64 forward of one batch element's first CHECK_DIMS dims: u, delta, z [d, l]; B, C [n, l]."""
    raw = delta + bias[:, None]
    dt = np.where(raw > 20, raw, np.log1p(np.exp(np.minimum(raw, 20))))
    h = np.zeros(A.shape)
    y = np.zeros(u.shape)
    for t in range(u.shape[1]):
        h = np.exp(dt[:, t, None] * A) * h + (dt[:, t] * u[:, t])[:, None] * B[None, :, t]
        y[:, t] = h @ C[:, t]
    y = y + D[:, None] * u
    return y * z / (1 + np.exp(-z))


def run(provider, quick: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    batch, dim, seqlen, dstate = (2, 1024, 2048, 16) if quick else (8, 4096, 2048, 16)
    dtype, esize = "bfloat16", 2
    u, z = provider.randn((batch, dim, seqlen), dtype), provider.randn((batch, dim, seqlen), dtype)
    delta = provider.randn((batch, dim, seqlen), dtype, scale=0.5, offset=-1.0)
    A = provider.from_numpy(-np.exp(np.random.randn(dim, dstate) * 0.5), "float32")
    B, C = provider.randn((batch, dstate, seqlen), dtype), provider.randn((batch, dstate, seqlen), dtype)
    D, bias = provider.randn((dim,), "float32"), provider.randn((dim,), "float32", scale=0.3)
    dout = provider.randn((batch, dim, seqlen), dtype)
    plan = K.scan_plan(seqlen)
    seq_shape = (batch, dim, seqlen)

    out, du, ddelta, dz = (provider.empty(seq_shape, dtype) for _ in range(4))
    states = provider.empty(K.states_shape(batch, dim, dstate, plan), "float32")
    work = provider.empty(K.workspace_shape(batch, dim, dstate, plan), "float32")
    acc = [provider.zeros(tuple(t.shape), "float32") for t in (A, B, C, D, bias)]

    def fwd(block_d=None):
        K.selective_scan_fwd(u, delta, A, B, C, out, D, z, bias, states, None, delta_softplus=True, plan=plan,
                             block_d=block_d)

    def bwd(block_d=None):
        for t in acc:
            t.zero_()
        K.selective_scan_bwd(u, delta, A, B, C, dout, states, work, du, ddelta, acc[0], acc[1], acc[2], D, z, bias,
                             acc[3], dz, acc[4], delta_softplus=True, plan=plan, block_d=block_d)

    def fwdbwd():
        fwd()
        bwd()

    def fwdbwd_alloc():  # what the op allocates around the launchers
        o = provider.empty(seq_shape, dtype)
        st = provider.empty(K.states_shape(batch, dim, dstate, plan), "float32")
        K.selective_scan_fwd(u, delta, A, B, C, o, D, z, bias, st, None, delta_softplus=True, plan=plan)
        w = provider.empty(K.workspace_shape(batch, dim, dstate, plan), "float32")
        g = [provider.empty(seq_shape, dtype) for _ in range(3)]
        a = [provider.zeros(tuple(t.shape), "float32") for t in (A, B, C, D, bias)]
        K.selective_scan_bwd(u, delta, A, B, C, dout, st, w, g[0], g[1], a[0], a[1], a[2], D, z, bias, a[3], g[2],
                             a[4], delta_softplus=True, plan=plan)
        return o, g, a

    grad_bytes = 3 * batch * dim * seqlen * esize + 2 * batch * dstate * seqlen * esize
    fwd()
    provider.synchronize()
    sl = (0, slice(0, CHECK_DIMS))
    ref = _reference64(*(provider.to_numpy(t[sl]) for t in (u, delta)), provider.to_numpy(A[:CHECK_DIMS]),
                       provider.to_numpy(B[0]), provider.to_numpy(C[0]), provider.to_numpy(D[:CHECK_DIMS]),
                       provider.to_numpy(z[sl]), provider.to_numpy(bias[:CHECK_DIMS]))
    ours = {"impl": "paddlenlp_fused/triton", "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
            "peak_GiB": peak_GiB(provider, fwdbwd_alloc, exclude_bytes=grad_bytes),
            "rel_err": rel_err(provider.to_numpy(out[sl]), ref)}
    ours["fwd_per_batch_ms"], ours["fwdbwd_per_batch_ms"] = ours["fwd_ms"] / batch, ours["fwdbwd_ms"] / batch

    # torch composition (mamba_ssm's selective_scan_ref), one batch element
    tu, tdelta, tz, tB, tC = (t[:1].detach().clone().requires_grad_(True) for t in (u, delta, z, B, C))
    tA, tD, tbias = (t.detach().clone().requires_grad_(True) for t in (A, D, bias))

    def torch_scan():
        dt = F.softplus(tdelta.float() + tbias[:, None])
        decay = torch.exp(torch.einsum("bdl,dn->bdln", dt, tA))
        dBu = torch.einsum("bdl,bnl,bdl->bdln", dt, tB.float(), tu.float())
        h = torch.zeros(1, dim, dstate, device=tu.device)
        ys = []
        for t in range(seqlen):
            h = decay[:, :, t] * h + dBu[:, :, t]
            ys.append(torch.einsum("bdn,bn->bd", h, tC[:, :, t].float()))
        y = torch.stack(ys, dim=2) + tu.float() * tD[:, None]
        return (y * F.silu(tz.float())).to(tu.dtype)

    def torch_fwd():
        with torch.no_grad():
            return torch_scan()

    def torch_fwdbwd():
        for t in (tu, tdelta, tz, tB, tC, tA, tD, tbias):
            t.grad = None
        torch_scan().backward(dout[:1])

    t_out = torch_fwd()
    torch_row = {"impl": "torch (sequential, batch 1)", "batch": 1, "fwd_ms": bench_ms(torch_fwd, 1, 1),
                 "fwdbwd_ms": bench_ms(torch_fwdbwd, 1, 1),
                 "peak_GiB": peak_GiB(provider, torch_fwdbwd, exclude_bytes=grad_bytes // batch),
                 "rel_err": rel_err(provider.to_numpy(t_out[sl]), ref)}
    torch_row["fwd_per_batch_ms"], torch_row["fwdbwd_per_batch_ms"] = torch_row["fwd_ms"], torch_row["fwdbwd_ms"]

    rows = [ours, torch_row]
    fwd_bytes = (4 * batch * dim * seqlen + 2 * batch * dstate * seqlen) * esize
    fwdbwd_bytes = fwd_bytes + (7 * batch * dim * seqlen + 2 * batch * dstate * seqlen) * esize
    for row in rows:
        scale = row.get("batch", batch) / batch
        row["fwd_TBps"] = TBps(fwd_bytes * scale, row["fwd_ms"])
        row["fwdbwd_TBps"] = TBps(fwdbwd_bytes * scale, row["fwdbwd_ms"])
        row["speedup_vs_torch"] = torch_row["fwdbwd_per_batch_ms"] / row["fwdbwd_per_batch_ms"]

    sweep = []
    if not quick:
        for block_d in (8, 16, 32):
            sweep.append({"kernel": "fwd", "block_d": block_d, "ms": bench_ms(lambda: fwd(block_d))})
        for block_d in (4, 8, 16):
            sweep.append({"kernel": "bwd", "block_d": block_d, "ms": bench_ms(lambda: bwd(block_d))})
    return {"shape": {"batch": batch, "dim": dim, "seqlen": seqlen, "dstate": dstate, "dtype": dtype,
                      "B_C": "input-dependent [batch, dstate, seqlen]", "D": True, "z": True, "delta_bias": True,
                      "delta_softplus": True},
            "plan": dict(plan._asdict()), "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes},
            "rows": rows, "sweep": sweep, "target": {"fwd_ms": 1.0, "fwdbwd_ms": 5.0},
            "memory_GiB": {"saved_states": _f32_bytes(states) / GiB, "bwd_workspace": _f32_bytes(work) / GiB}}


def _f32_bytes(t) -> int:
    return 4 * int(np.prod([int(s) for s in t.shape]))
