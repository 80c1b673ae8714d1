"""SwiGLU fwd+bwd, x [16384, 2*14336] bf16 (PERFORMANCE.md): our Triton kernels against the torch
composition (eager and torch.compile) in the same process.

Bytes: forward reads x (2H) and writes out (H); backward reads x (2H) and dout (H) and writes dx
(2H): 8 elements a row-position, 16 bytes in bf16.
"""

from __future__ import annotations

from common import GiB, TBps, bench_ms, peak_GiB

from paddlenlp_fused.kernels.triton.gated_activation import gated_activation_bwd, gated_activation_fwd
from paddlenlp_fused.testing.numerics import rel_err


def run(provider, quick: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    M, H = (2048, 14336) if quick else (16384, 14336)
    dtype = "bfloat16"
    x = provider.randn((M, 2 * H), dtype)
    dy = provider.randn((M, H), dtype)
    out = provider.empty((M, H), dtype)
    dx = provider.empty((M, 2 * H), dtype)
    esize = 2
    fwd_bytes = 3 * M * H * esize
    fwdbwd_bytes = 8 * M * H * esize

    def ours_fwd():
        gated_activation_fwd(x, out, "silu")

    def ours_fwdbwd():
        gated_activation_fwd(x, out, "silu")
        gated_activation_bwd(x, dy, dx, "silu")

    def ours_alloc():
        o = provider.empty((M, H), dtype)
        d = provider.empty((M, 2 * H), dtype)
        gated_activation_fwd(x, o, "silu")
        gated_activation_bwd(x, dy, d, "silu")
        return o, d

    ref = (F.silu(x[:, :H].double()) * x[:, H:].double())
    ours_fwd()
    provider.synchronize()
    rows = [{"impl": "paddlenlp_fused/triton", "fwd_ms": bench_ms(ours_fwd), "fwdbwd_ms": bench_ms(ours_fwdbwd),
             "peak_GiB": peak_GiB(provider, ours_alloc, exclude_bytes=2 * M * H * esize),
             "rel_err": rel_err(out.double().cpu().numpy(), ref.cpu().numpy())}]

    def torch_eager(t):
        a, b = t.chunk(2, dim=-1)
        return F.silu(a) * b

    compiled = torch.compile(torch_eager)
    for name, fn in (("torch", torch_eager), ("torch.compile", compiled)):
        xg = x.detach().clone().requires_grad_(True)

        def fwd():
            with torch.no_grad():
                return fn(xg)

        def fwdbwd():
            xg.grad = None
            fn(xg).backward(dy)
            return xg.grad

        fwdbwd()
        y = fwd()
        rows.append({"impl": name, "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
                     "peak_GiB": peak_GiB(provider, fwdbwd, exclude_bytes=2 * M * H * esize),
                     "rel_err": rel_err(y.double().cpu().numpy(), ref.cpu().numpy())})
        del xg
    for row in rows:
        row["fwd_TBps"] = TBps(fwd_bytes, row["fwd_ms"])
        row["fwdbwd_TBps"] = TBps(fwdbwd_bytes, row["fwdbwd_ms"])
    torch_ms = rows[1]["fwdbwd_ms"]
    for row in rows:
        row["speedup_vs_torch"] = torch_ms / row["fwdbwd_ms"]
    return {"shape": {"M": M, "two_H": 2 * H, "dtype": dtype},
            "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes}, "rows": rows,
            "target": {"fwdbwd_TBps": 3.4}}
