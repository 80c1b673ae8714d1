"""SwiGLU fwd+bwd, x [16384, 2*14336] bf16 (PERFORMANCE.md): our Triton kernels against the torch
composition (eager and torch.compile) and Liger-Kernel in the same process (optional rows: a peer
that does not import or run is listed under ``skipped``).

Bytes: forward reads x (2H) and writes out (H); backward reads x (2H) and dout (H) and writes dx
(2H): 8 elements a row-position, 16 bytes in bf16.
"""

from __future__ import annotations

import peers
from common import TBps, autograd_row, bench_ms, optional_row, peak_GiB

from paddlenlp_fused.kernels.triton.gated_activation import gated_activation_bwd, gated_activation_fwd
from paddlenlp_fused.testing.numerics import rel_err

LIGER = "Liger SiLUMul (gate, up apart; gradients written into its inputs)"


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
    ref_np = ref.cpu().numpy()
    del ref
    ours_fwd()
    provider.synchronize()
    grad_bytes = 2 * M * H * esize  # dx
    rows = [{"impl": "paddlenlp_fused/triton", "fwd_ms": bench_ms(ours_fwd), "fwdbwd_ms": bench_ms(ours_fwdbwd),
             "peak_GiB": peak_GiB(provider, ours_alloc, exclude_bytes=grad_bytes),
             "rel_err": rel_err(out.double().cpu().numpy(), ref_np)}]
    skipped = {}

    def check(y, grads):
        return {"rel_err": rel_err(y.double().cpu().numpy(), ref_np)}

    def torch_eager(t):
        a, b = t.chunk(2, dim=-1)
        return F.silu(a) * b

    xg = x.detach().clone().requires_grad_(True)
    rows.append(autograd_row(provider, "torch", lambda: torch_eager(xg), [xg], dy, check))
    optional_row(rows, skipped, "torch.compile", lambda: autograd_row(
        provider, "torch.compile", lambda f=torch.compile(torch_eager): f(xg), [xg], dy, check))
    del xg

    def liger_row():
        # Liger takes gate and up as two tensors and writes their gradients into them (its backward
        # returns its saved inputs overwritten): contiguous halves, made once, outside the timing
        silu_mul = peers.load("liger_kernel.ops.swiglu").LigerSiLUMulFunction
        a, b = (t.contiguous().requires_grad_(True) for t in x.detach().chunk(2, dim=-1))
        return dict(autograd_row(provider, LIGER, lambda: silu_mul.apply(a, b), [a, b], dy, check),
                    peer=peers.describe("liger_kernel"))

    optional_row(rows, skipped, LIGER, liger_row)
    for row in rows:
        row["fwd_TBps"] = TBps(fwd_bytes, row["fwd_ms"])
        row["fwdbwd_TBps"] = TBps(fwdbwd_bytes, row["fwdbwd_ms"])
    torch_ms = rows[1]["fwdbwd_ms"]
    for row in rows:
        row["speedup_vs_torch"] = torch_ms / row["fwdbwd_ms"]
    return {"shape": {"M": M, "two_H": 2 * H, "dtype": dtype},
            "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes}, "rows": rows, "skipped": skipped,
            "target": {"fwdbwd_TBps": 3.4}}
