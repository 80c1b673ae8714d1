"""Mamba-1 selective scan fwd / fwd+bwd (PERFORMANCE.md): u, delta, z [8, 4096, 2048] bf16, dstate 16,
input-dependent B/C [8, 16, 2048] bf16, D and delta_bias fp32, softplus. Our CUDA and Triton kernels
against the torch composition (mamba_ssm's sequential ``selective_scan_ref``) and, where its CUDA
extension was built, mamba_ssm's ``selective_scan_fn``, in the same process.

The torch composition runs a Python loop over seqlen (~160-230 ms per batch element forward on an
H200), so it is timed once on batch 1 and reported per batch element next to ours
(``*_per_batch_ms``); ``speedup_vs_torch`` compares those. ``sweep`` (``run.py --sweeps``) times
the other launch configurations of both backends (CUDA: dims (warps) a block; Triton: dims a
program, and in the backward dims each thread holds); the defaults were picked from it. Each backend's output and du are
checked against a float64 recurrence on the first CHECK_DIMS dims of batch 0 (``rel_err``,
``rel_err_du``).

Bytes (bf16): forward reads u, delta, z, B, C and writes out; the backward reads u, delta, z, B, C,
dout and writes du, ddelta, dz (plus fp32 atomics into dB, dC).
"""

from __future__ import annotations

import numpy as np
import peers
from common import GiB, TBps, autograd_row, bench_ms, optional_row, peak_GiB, run_once

from paddlenlp_fused.kernels.cuda import selective_scan as CK
from paddlenlp_fused.kernels.triton import selective_scan as TK
from paddlenlp_fused.testing.numerics import rel_err

CUDA_PEER = "mamba_ssm CUDA selective_scan_fn"
CHECK_DIMS = 64  # dims of batch 0 checked against float64 (a sequential numpy loop)
KERNELS = {"paddlenlp_fused/cuda": CK, "paddlenlp_fused/triton": TK}
# launcher options timed besides each backend's defaults: (forward, backward) lists of keyword sets
SWEEP = {"paddlenlp_fused/cuda": ([dict(warps=w) for w in (1, 2, 4, 8)], [dict(warps=w) for w in (2, 4, 8)]),
         "paddlenlp_fused/triton": ([dict(block_d=b) for b in (16, 64)],
                                    [dict(dim_regs=1), dict(dim_regs=4), dict(block_d=8)])}


def _reference64(u, delta, A, B, C, D, z, bias, dout):
    """float64 forward of one batch element's first CHECK_DIMS dims (u, delta, z, dout [d, l]; B, C
    [n, l]; the other dims do not touch them) and the adjoint's du."""
    raw = delta + bias[:, None]
    dt = np.where(raw > 20, raw, np.log1p(np.exp(np.minimum(raw, 20))))
    h = np.zeros(A.shape)
    y = np.zeros(u.shape)
    for t in range(u.shape[1]):
        h = np.exp(dt[:, t, None] * A) * h + (dt[:, t] * u[:, t])[:, None] * B[None, :, t]
        y[:, t] = h @ C[:, t]
    silu = z / (1 + np.exp(-z))
    out = (y + D[:, None] * u) * silu
    dy = dout * silu
    g = np.zeros(A.shape)
    du = D[:, None] * dy
    for t in reversed(range(u.shape[1])):
        if t + 1 < u.shape[1]:
            g = g * np.exp(dt[:, t + 1, None] * A)
        g = g + C[None, :, t] * dy[:, t, None]
        du[:, t] += (g * dt[:, t, None] * B[None, :, t]).sum(-1)
    return out, du


def run(provider, quick: bool = False, sweep: bool = False) -> dict:
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
    seq_shape = (batch, dim, seqlen)
    grad_bytes = 3 * batch * dim * seqlen * esize + 2 * batch * dstate * seqlen * esize
    sl = (0, slice(0, CHECK_DIMS))
    ref_out, ref_du = _reference64(*(provider.to_numpy(t[sl]) for t in (u, delta)),
                                   provider.to_numpy(A[:CHECK_DIMS]), provider.to_numpy(B[0]),
                                   provider.to_numpy(C[0]), provider.to_numpy(D[:CHECK_DIMS]),
                                   provider.to_numpy(z[sl]), provider.to_numpy(bias[:CHECK_DIMS]),
                                   provider.to_numpy(dout[sl]))

    rows, launch_sweep, memory, skipped = [], [], {}, {}
    for impl, K in KERNELS.items():
        plan = K.scan_plan(seqlen)
        out, du, ddelta, dz = (provider.empty(seq_shape, dtype) for _ in range(4))
        states = provider.empty(K.states_shape(batch, dim, dstate, plan), "float32")
        work_shape = K.workspace_shape(batch, dim, dstate, plan)
        work = None if work_shape is None else provider.empty(work_shape, "float32")
        acc = [provider.zeros(tuple(t.shape), "float32") for t in (A, B, C, D, bias)]
        def fwd(options=None, K=K, plan=plan, out=out, states=states):
            K.selective_scan_fwd(u, delta, A, B, C, out, D, z, bias, states, None, delta_softplus=True, plan=plan,
                                 **(options or {}))

        def bwd(options=None, K=K, plan=plan, states=states, work=work, acc=acc, du=du, ddelta=ddelta, dz=dz):
            for t in acc:
                t.zero_()
            K.selective_scan_bwd(u, delta, A, B, C, dout, states, work, du, ddelta, acc[0], acc[1], acc[2], D, z,
                                 bias, acc[3], dz, acc[4], delta_softplus=True, plan=plan, **(options or {}))

        def fwdbwd(fwd=fwd, bwd=bwd):
            fwd()
            bwd()

        def fwdbwd_alloc(K=K, plan=plan, work_shape=work_shape):  # what the op allocates around the launchers
            o = provider.empty(seq_shape, dtype)
            st = provider.empty(K.states_shape(batch, dim, dstate, plan), "float32")
            K.selective_scan_fwd(u, delta, A, B, C, o, D, z, bias, st, None, delta_softplus=True, plan=plan)
            w = None if work_shape is None else provider.empty(work_shape, "float32")
            g = [provider.empty(seq_shape, dtype) for _ in range(3)]
            a = [provider.zeros(tuple(t.shape), "float32") for t in (A, B, C, D, bias)]
            K.selective_scan_bwd(u, delta, A, B, C, dout, st, w, g[0], g[1], a[0], a[1], a[2], D, z, bias, a[3],
                                 g[2], a[4], delta_softplus=True, plan=plan)
            return o, g, a

        fwdbwd()
        provider.synchronize()
        row = {"impl": impl, "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
               "peak_GiB": peak_GiB(provider, fwdbwd_alloc, exclude_bytes=grad_bytes),
               "rel_err": rel_err(provider.to_numpy(out[sl]), ref_out),
               "rel_err_du": rel_err(provider.to_numpy(du[sl]), ref_du)}
        row["fwd_per_batch_ms"], row["fwdbwd_per_batch_ms"] = row["fwd_ms"] / batch, row["fwdbwd_ms"] / batch
        rows.append(row)
        print(f"{impl}: fwd {row['fwd_ms']:.3f} ms, fwd+bwd {row['fwdbwd_ms']:.3f} ms, rel_err {row['rel_err']:.2e}, "
              f"du {row['rel_err_du']:.2e}", flush=True)
        memory[impl] = {"saved_states_GiB": _f32_bytes(states) / GiB,
                        "bwd_workspace_GiB": 0.0 if work is None else _f32_bytes(work) / GiB}
        if sweep and not quick:
            fwd_options, bwd_options = SWEEP[impl]
            for kernel, fn, option_sets in (("fwd", fwd, fwd_options), ("bwd", bwd, bwd_options)):
                for options in option_sets:
                    ms = bench_ms(lambda: fn(options), rep_ms=100)
                    launch_sweep.append({"impl": impl, "kernel": kernel, **options, "ms": ms})
                    print(f"  sweep {impl} {kernel} {options}: {ms:.3f} ms", flush=True)
        del out, du, ddelta, dz, states, work, acc

    # torch composition (mamba_ssm's selective_scan_ref), one batch element, timed once
    tu, tdelta, tz, tB, tC = (t[:1].detach().clone().requires_grad_(True) for t in (u, delta, z, B, C))
    tA, tD, tbias = (t.detach().clone().requires_grad_(True) for t in (A, D, bias))
    leaves = (tu, tdelta, tz, tB, tC, tA, tD, tbias)

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
        torch_scan().backward(dout[:1])

    t_out = torch_fwd()  # warm-up, and the output checked
    # timed once (a Python loop of seqlen steps): wall clock of one synchronised call, and its peak
    fwd_ms, _ = run_once(provider, torch_fwd)
    fwdbwd_ms, peak = run_once(provider, torch_fwdbwd, grad_bytes // batch, leaves)
    torch_row = {"impl": "torch (sequential, batch 1)", "batch": 1, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
                 "peak_GiB": peak, "rel_err": rel_err(provider.to_numpy(t_out[sl]), ref_out),
                 "rel_err_du": rel_err(provider.to_numpy(tu.grad[sl]), ref_du),
                 "timing": "one call, wall clock (not do_bench)"}
    torch_row["fwd_per_batch_ms"], torch_row["fwdbwd_per_batch_ms"] = fwd_ms, fwdbwd_ms
    rows.append(torch_row)
    print(f"torch: fwd {fwd_ms:.1f} ms, fwd+bwd {fwdbwd_ms:.1f} ms (batch 1)", flush=True)
    del leaves, t_out, tu, tdelta, tz, tB, tC, tA, tD, tbias
    skipped["torch.compile"] = "not run: the composition is a Python loop of seqlen steps"

    def cuda_peer():  # only where mamba_ssm's selective-scan CUDA extension was built (README: "Peers")
        fn = peers.load("mamba_ssm.ops.selective_scan_interface").selective_scan_fn
        pl = [t.detach().clone().requires_grad_(True) for t in (u, delta, A, B, C, D, z, bias)]

        def check(out, grads):
            return {"rel_err": rel_err(provider.to_numpy(out[sl]), ref_out),
                    "rel_err_du": rel_err(provider.to_numpy(grads[0][sl]), ref_du)}

        row = autograd_row(provider, CUDA_PEER, lambda: fn(*pl[:7], delta_bias=pl[7], delta_softplus=True), pl,
                           dout, check)
        row["fwd_per_batch_ms"], row["fwdbwd_per_batch_ms"] = row["fwd_ms"] / batch, row["fwdbwd_ms"] / batch
        return dict(row, peer=peers.describe("mamba_ssm"))

    optional_row(rows, skipped, CUDA_PEER, cuda_peer)

    fwd_bytes = (4 * batch * dim * seqlen + 2 * batch * dstate * seqlen) * esize
    fwdbwd_bytes = fwd_bytes + (7 * batch * dim * seqlen + 2 * batch * dstate * seqlen) * esize
    for row in rows:
        scale = row.get("batch", batch) / batch
        row["fwd_TBps"] = TBps(fwd_bytes * scale, row["fwd_ms"])
        row["fwdbwd_TBps"] = TBps(fwdbwd_bytes * scale, row["fwdbwd_ms"])
        row["speedup_vs_torch"] = torch_row["fwdbwd_per_batch_ms"] / row["fwdbwd_per_batch_ms"]
    return {"shape": {"batch": batch, "dim": dim, "seqlen": seqlen, "dstate": dstate, "dtype": dtype,
                      "B_C": "input-dependent [batch, dstate, seqlen]", "D": True, "z": True, "delta_bias": True,
                      "delta_softplus": True},
            "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes},
            "rows": rows, "skipped": skipped, "sweep": launch_sweep, "target": {"fwd_ms": 1.0, "fwdbwd_ms": 5.0},
            "memory": memory}


def _f32_bytes(t) -> int:
    return 4 * int(np.prod([int(s) for s in t.shape]))
