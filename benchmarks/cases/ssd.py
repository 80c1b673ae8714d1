"""Mamba-2 SSD fwd / fwd+bwd (PERFORMANCE.md): x [4, 4096, 64 heads, 128] bf16, dstate 128, 1 group,
chunk 256, D (fp32), dt bf16 with dt_bias (fp32) and softplus, as Mamba-2 calls it. Our Triton
kernels (``kernels/triton/ssd.py`` forward, ``kernels/triton/ssd_backward.py`` backward) against a
torch composition of the same chunked algorithm (written below with torch ops: bf16 matmuls, fp32
cumsum/exp/states; eager, and torch.compile) and mamba_ssm's Triton ``mamba_chunk_scan_combined`` in
the same process; plus ours and the eager composition at seqlen 32768, batch 1 (``seqlen_32768``).

``rel_err``: y against the same composition in float64, on batch 0. ``fwd_TFLOPs``: the
algorithm's matmul work (CB, chunk states, causal half of the intra-chunk product, inter-chunk
product) over the forward time; ``fwd_TBps``: inputs read once and y written once over the forward
time (the floor of any implementation). ``sweep`` (``run.py --sweeps``) times the forward under
other tile configs; ``autotuned`` records what the autotuner picked for stages 3, 3+4 and 5.
"""

from __future__ import annotations

import math

import numpy as np
import peers
from common import GiB, TBps, TFLOPs, autograd_row, bench_ms, optional_row, peak_GiB

from paddlenlp_fused.kernels.triton import ssd as K
from paddlenlp_fused.testing.numerics import rel_err

NHEADS, HEADDIM, DSTATE, NGROUPS, CHUNK = 64, 128, 128, 1, 256
TORCH = "torch (chunked composition, bf16 matmuls)"
MAMBA = "mamba_ssm Triton mamba_chunk_scan_combined"


def torch_chunked(x, dt, A, B, C, D, dt_bias, chunk, mm_dtype):
    """The SSD chunked algorithm with torch ops (seqlen a multiple of chunk, no seq_idx): matmul
    operands in ``mm_dtype``, the rest in fp32 (float64 when mm_dtype is float64). Returns y in
    x's dtype (float64 for the float64 run) and the final state."""
    import torch
    import torch.nn.functional as F

    batch, seqlen, nheads, headdim = x.shape
    ngroups, dstate = B.shape[2:]
    rep, nc = nheads // ngroups, seqlen // chunk
    acc = torch.float64 if mm_dtype == torch.float64 else torch.float32
    dtp = F.softplus(dt.to(acc) + dt_bias.to(acc))
    dtk = dtp.reshape(batch, nc, chunk, ngroups, rep).permute(0, 3, 4, 1, 2)            # [b, g, r, c, K]
    cs = torch.cumsum(dtk * A.to(acc).reshape(ngroups, rep)[None, :, :, None, None], dim=-1)
    xk = x.reshape(batch, nc, chunk, ngroups, rep, headdim)
    Bk = B.reshape(batch, nc, chunk, ngroups, dstate)
    Ck = C.reshape(batch, nc, chunk, ngroups, dstate)
    CB = torch.einsum("bctgn,bcsgn->bgcts", Ck.to(mm_dtype), Bk.to(mm_dtype)).to(acc)   # [b, g, c, K, K]
    causal = torch.tril(torch.ones(chunk, chunk, dtype=torch.bool, device=x.device))
    decay = torch.exp(torch.where(causal, cs[..., :, None] - cs[..., None, :], -math.inf))
    scores = (CB[:, :, None] * decay * dtk[..., None, :]).to(mm_dtype)                 # [b, g, r, c, t, s]
    y = torch.einsum("bgrcts,bcsgrp->bctgrp", scores, xk.to(mm_dtype)).to(acc)
    w = (torch.exp(cs[..., -1:] - cs) * dtk).permute(0, 3, 4, 1, 2)[..., None]          # [b, c, K, g, r, 1]
    own = torch.einsum("bcsgrp,bcsgn->bcgrpn", (xk.to(acc) * w).to(mm_dtype), Bk.to(mm_dtype)).to(acc)
    carry = torch.exp(cs[..., -1])                                                       # [b, g, r, c]
    h = x.new_zeros((batch, ngroups, rep, headdim, dstate), dtype=acc)
    states = []
    for c in range(nc):
        states.append(h)
        h = carry[..., c, None, None] * h + own[:, c]
    states = torch.stack(states, dim=1)                                                  # [b, c, g, r, p, n]
    inter = torch.einsum("bctgn,bcgrpn->bctgrp", Ck.to(mm_dtype), states.to(mm_dtype)).to(acc)
    y = y + inter * torch.exp(cs).permute(0, 3, 4, 1, 2)[..., None]
    y = y.reshape(batch, seqlen, nheads, headdim) + D.to(acc)[:, None] * x.to(acc)
    out_dtype = torch.float64 if mm_dtype == torch.float64 else x.dtype
    return y.to(out_dtype), h.reshape(batch, nheads, headdim, dstate)


def _flops(batch, seqlen):
    nc = seqlen // CHUNK
    cb = batch * nc * NGROUPS * CHUNK * CHUNK * DSTATE * 2
    per_head = batch * nc * NHEADS * CHUNK * HEADDIM * DSTATE * 2  # chunk states; also the inter-chunk product
    intra = batch * nc * NHEADS * (CHUNK * (CHUNK + 1) // 2) * HEADDIM * 2
    return cb + 2 * per_head + intra


def _measure(provider, batch, seqlen, with_torch=True, with_peers=False, sweep=False):
    import torch

    from paddlenlp_fused.kernels.triton import ssd_backward as KB

    dtype, esize = "bfloat16", 2
    xs, bs = (batch, seqlen, NHEADS, HEADDIM), (batch, seqlen, NGROUPS, DSTATE)
    x, B, C = provider.randn(xs, dtype), provider.randn(bs, dtype), provider.randn(bs, dtype)
    dt = provider.randn((batch, seqlen, NHEADS), dtype, scale=0.5, offset=-1.0)
    A = provider.from_numpy(-np.exp(np.random.randn(NHEADS) * 0.5), "float32")
    D, dt_bias = provider.randn((NHEADS,), "float32"), provider.randn((NHEADS,), "float32", scale=0.3)
    dout = provider.randn(xs, dtype)
    shapes = K.buffer_shapes(batch, seqlen, NHEADS, HEADDIM, NGROUPS, DSTATE, CHUNK)
    dtypes = {k: K.states_dtype(dtype, batch, NHEADS) if k == "states" else "float32" for k in shapes}
    buf = {k: provider.empty(v, dtypes[k]) for k, v in shapes.items()}
    out = provider.empty(xs, dtype)
    opts = dict(chunk_size=CHUNK, D=D, dt_bias=dt_bias, dt_softplus=True)
    work_shapes = KB.workspace_shapes(batch, seqlen, NHEADS, HEADDIM, DSTATE, CHUNK, False, dtype, dtypes["states"])
    work = {k: provider.empty(s, d) for k, (s, d) in work_shapes.items()}
    dx, ddt = provider.empty(xs, dtype), provider.empty(dt.shape, dtype)
    acc = {"dA": provider.zeros((NHEADS,)), "dB": provider.zeros(bs), "dC": provider.zeros(bs),
           "dD": provider.zeros((NHEADS,)), "ddt_bias": provider.zeros((NHEADS,))}

    def fwd(config=None, states=buf["states"]):
        K.ssd_chunked_fwd(x, dt, A, B, C, out, buf["dt_out"], buf["dA_cumsum"], states, buf["CB"],
                          buf["final_states"], config=config, **opts)

    def bwd():
        for t in acc.values():
            t.zero_()
        KB.ssd_chunked_bwd(dout, x, dt, A, B, C, buf["dt_out"], buf["dA_cumsum"], buf["states"], buf["CB"], dx, ddt,
                           acc["dA"], acc["dB"], acc["dC"], chunk_size=CHUNK, D=D, dD=acc["dD"], dt_bias=dt_bias,
                           ddt_bias=acc["ddt_bias"], dt_softplus=True, workspace=work)

    def fwdbwd():
        fwd()
        bwd()

    def fwdbwd_alloc():  # what the op allocates around the launchers
        o = provider.empty(xs, dtype)
        bb = {k: provider.empty(v, dtypes[k]) for k, v in shapes.items()}
        K.ssd_chunked_fwd(x, dt, A, B, C, o, bb["dt_out"], bb["dA_cumsum"], bb["states"], bb["CB"],
                          bb["final_states"], **opts)
        w = {k: provider.empty(s, d) for k, (s, d) in work_shapes.items()}
        g = [provider.empty(xs, dtype), provider.empty(dt.shape, dtype)]
        a = [provider.zeros(s) for s in ((NHEADS,), bs, bs, (NHEADS,), (NHEADS,))]
        KB.ssd_chunked_bwd(dout, x, dt, A, B, C, bb["dt_out"], bb["dA_cumsum"], bb["states"], bb["CB"], g[0], g[1],
                           a[0], a[1], a[2], chunk_size=CHUNK, D=D, dD=a[3], dt_bias=dt_bias, ddt_bias=a[4],
                           dt_softplus=True, workspace=w)
        return o, bb, w, g, a

    numel = {k: math.prod(s) for k, s in (("x", xs), ("dt", (batch, seqlen, NHEADS)), ("B", bs))}
    grad_bytes = (numel["x"] + numel["dt"] + 2 * numel["B"]) * esize
    fwd()
    provider.synchronize()
    with torch.no_grad():
        y64, _ = torch_chunked(x[:1], dt[:1], A, B[:1], C[:1], D, dt_bias, CHUNK, torch.float64)
    ref = provider.to_numpy(y64)
    ours = {"impl": "paddlenlp_fused/triton", "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
            "peak_GiB": peak_GiB(provider, fwdbwd_alloc, exclude_bytes=grad_bytes),
            "rel_err": rel_err(provider.to_numpy(out[:1]), ref)}
    rows = [ours]
    del y64
    skipped = {}
    if with_torch:
        leaves = [t.detach().clone().requires_grad_(True) for t in (x, dt, A, B, C, D, dt_bias)]

        def check(y, grads):
            return {"rel_err": rel_err(provider.to_numpy(y[:1]), ref)}

        def composition(*args):
            return torch_chunked(*args, CHUNK, torch.bfloat16)[0]

        rows.append(autograd_row(provider, TORCH, lambda: composition(*leaves), leaves, dout, check))
        if with_peers:
            compiled = torch.compile(composition)
            optional_row(rows, skipped, "torch.compile", lambda: autograd_row(
                provider, "torch.compile", lambda: compiled(*leaves), leaves, dout, check))

            def mamba():
                fn = peers.load("mamba_ssm.ops.triton.ssd_combined").mamba_chunk_scan_combined
                lx, ldt, lA, lB, lC, lD, lbias = leaves
                return dict(autograd_row(provider, MAMBA, lambda: fn(lx, ldt, lA, lB, lC, CHUNK, D=lD, dt_bias=lbias,
                                                                       dt_softplus=True),
                                         leaves, dout, check), peer=peers.describe("mamba_ssm"))

            optional_row(rows, skipped, MAMBA, mamba)
        del leaves
    io_bytes = (2 * numel["x"] + numel["dt"] + 2 * numel["B"]) * esize
    for row in rows:
        row["fwd_TFLOPs"] = TFLOPs(_flops(batch, seqlen), row["fwd_ms"])
        row["fwd_TBps"] = TBps(io_bytes, row["fwd_ms"])
        if with_torch:
            row["speedup_vs_torch"] = {k: rows[1][k] / row[k] for k in ("fwd_ms", "fwdbwd_ms")}  # rows[1]: torch
    print(f"ssd batch={batch} seqlen={seqlen}:", rows, flush=True)
    configs = []
    if sweep:  # fixed tiles (SSDConfig) for stages 3+4 and 5, one field group changed at a time
        base = K.DEFAULT_CONFIG._replace(fuse_state_passing=True, recompute_cb=True, scan_m_loop=False)
        variants = [base._replace(fuse_state_passing=False)]  # stages 3 and 4 apart (fp32 states)
        variants += [base._replace(fused_block_p=bp, fused_block_n=bn, fused_block_k=bk, fused_warps=w, fused_stages=s)
                     for bp, bn, bk, w, s in ((128, 128, 128, 8, 2), (128, 128, 64, 8, 3), (128, 128, 256, 8, 1),
                                              (64, 128, 128, 4, 2), (64, 128, 256, 4, 2), (128, 64, 128, 4, 2))]
        variants += [base._replace(scan_block_m=bm, scan_block_p=bp, scan_block_k=bk, scan_warps=w, scan_stages=s,
                                   recompute_cb=rc, scan_m_loop=ml)
                     for bm, bp, bk, w, s, rc, ml in (
                         (64, 128, 32, 4, 3, True, False), (64, 128, 64, 4, 3, True, False),
                         (64, 128, 128, 4, 2, True, False), (64, 128, 64, 8, 2, True, False),
                         (64, 64, 64, 4, 2, True, False), (128, 128, 64, 8, 2, True, False),
                         (128, 128, 32, 8, 3, True, False), (128, 128, 64, 8, 3, True, False),
                         (128, 128, 128, 8, 2, True, False), (128, 64, 64, 4, 2, True, False),
                         (64, 128, 64, 4, 2, False, True), (64, 128, 32, 4, 3, False, True),
                         (128, 128, 64, 8, 2, False, True), (64, 128, 64, 4, 2, False, False),
                         (128, 128, 64, 8, 2, False, False))]
        variants += [base._replace(split_scores=True), base._replace(scan_heads_first=False)]
        states32 = provider.empty(shapes["states"], "float32")
        for cfg in [base] + variants:
            states = buf["states"] if K.states_dtype(dtype, batch, NHEADS, cfg) == dtypes["states"] else states32
            try:
                ms = bench_ms(lambda: fwd(cfg, states), 10, 60)
            except Exception as exc:  # a config over the shared-memory limit: report it, keep sweeping
                ms = f"failed: {type(exc).__name__}: {str(exc)[:120]}"
            configs.append({"config": dict(cfg._asdict()), "fwd_ms": ms})
            print("sweep", dict(cfg._asdict()), ms, flush=True)
    return rows, configs, skipped


def run(provider, quick: bool = False, sweep: bool = False) -> dict:
    batch, seqlen = (1, 1024) if quick else (4, 4096)
    rows, configs, skipped = _measure(provider, batch, seqlen, with_peers=True, sweep=sweep and not quick)
    long_rows, _, _ = _measure(provider, 1, 8192 if quick else 32768, with_torch=not quick)
    states_dtype = K.states_dtype("bfloat16", batch, NHEADS)
    return {"shape": {"batch": batch, "seqlen": seqlen, "nheads": NHEADS, "headdim": HEADDIM, "dstate": DSTATE,
                      "ngroups": NGROUPS, "chunk_size": CHUNK, "dtype": "bfloat16", "D": True, "dt_bias": True,
                      "dt_softplus": True},
            "rows": rows, "skipped": skipped, "target": {"fwd_ms": 0.70, "fwdbwd_ms": 3.2},
            "seqlen_32768": {"shape": {"batch": 1, "seqlen": 8192 if quick else 32768}, "rows": long_rows},
            "sweep": configs, "autotuned": K.tuned_configs(),
            "states_dtype": states_dtype,
            "memory_GiB": {"states": (2 if states_dtype == "bfloat16" else 4) * math.prod(
                K.buffer_shapes(batch, seqlen, NHEADS, HEADDIM, NGROUPS, DSTATE, CHUNK)["states"]) / GiB}}
