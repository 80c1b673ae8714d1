"""Causal depthwise conv1d fwd / fwd+bwd (PERFORMANCE.md): x [8, 4096, 2048] bf16 (channel-first),
width 4, bias, silu. Our Triton kernels against the torch composition (``F.conv1d`` with padding
w - 1 and groups = dim, truncated, then silu) in the same process.

Bytes (bf16): forward reads x and writes out (2 elements a position); the backward reads x and dout
and writes dx (3 more). ``sweep`` times other tile shapes (dims a program x positions it walks).
"""

from __future__ import annotations

from common import TBps, bench_ms, peak_GiB

from paddlenlp_fused.kernels.triton import causal_conv1d as K
from paddlenlp_fused.testing.numerics import rel_err


def run(provider, quick: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    batch, dim, seqlen, width = (2, 1024, 2048, 4) if quick else (8, 4096, 2048, 4)
    dtype, esize = "bfloat16", 2
    shape = (batch, dim, seqlen)
    x, dout = provider.randn(shape, dtype), provider.randn(shape, dtype)
    weight, bias = provider.randn((dim, width), dtype, scale=0.5), provider.randn((dim,), dtype)
    out, dx = provider.empty(shape, dtype), provider.empty(shape, dtype)
    dw, db = provider.zeros((dim, width), "float32"), provider.zeros((dim,), "float32")

    def fwd(block_d=None, segment=None):
        K.causal_conv1d_fwd(x, weight, out, bias, activation="silu", block_d=block_d, segment=segment)

    def bwd(block_d=None, segment=None):
        dw.zero_()
        db.zero_()
        K.causal_conv1d_bwd(x, weight, dout, dx, dw, bias, db, activation="silu", block_d=block_d, segment=segment)

    def fwdbwd():
        fwd()
        bwd()

    def fwdbwd_alloc():
        o, g = provider.empty(shape, dtype), provider.empty(shape, dtype)
        gw, gb = provider.zeros((dim, width), "float32"), provider.zeros((dim,), "float32")
        K.causal_conv1d_fwd(x, weight, o, bias, activation="silu")
        K.causal_conv1d_bwd(x, weight, dout, g, gw, bias, gb, activation="silu")
        return o, g, gw, gb

    def torch_conv(xx, ww, bb):
        return F.silu(F.conv1d(xx, ww[:, None, :], bb, padding=width - 1, groups=dim)[..., :seqlen])

    with torch.no_grad():
        ref = torch_conv(x.double(), weight.double(), bias.double())
    grad_bytes = batch * dim * seqlen * esize  # dx (dweight, dbias are negligible)
    fwd()
    provider.synchronize()
    rows = [{"impl": "paddlenlp_fused/triton", "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd),
             "peak_GiB": peak_GiB(provider, fwdbwd_alloc, exclude_bytes=grad_bytes),
             "rel_err": rel_err(out.double().cpu().numpy(), ref.cpu().numpy())}]

    tx, tw, tb = (t.detach().clone().requires_grad_(True) for t in (x, weight, bias))

    def torch_fwd():
        with torch.no_grad():
            return torch_conv(tx, tw, tb)

    def torch_fwdbwd():
        tx.grad = tw.grad = tb.grad = None
        torch_conv(tx, tw, tb).backward(dout)

    t_out = torch_fwd()
    rows.append({"impl": "torch", "fwd_ms": bench_ms(torch_fwd), "fwdbwd_ms": bench_ms(torch_fwdbwd),
                 "peak_GiB": peak_GiB(provider, torch_fwdbwd, exclude_bytes=grad_bytes),
                 "rel_err": rel_err(t_out.double().cpu().numpy(), ref.cpu().numpy())})
    del t_out, ref

    fwd_bytes = 2 * batch * dim * seqlen * esize
    fwdbwd_bytes = 5 * batch * dim * seqlen * esize
    for row in rows:
        row["fwd_TBps"] = TBps(fwd_bytes, row["fwd_ms"])
        row["fwdbwd_TBps"] = TBps(fwdbwd_bytes, row["fwdbwd_ms"])
        row["speedup_vs_torch"] = rows[1]["fwdbwd_ms"] / row["fwdbwd_ms"]

    sweep = []
    if not quick:
        for block_d, segment in ((32, 256), (64, 256), (128, 256), (64, 128), (64, 512), (64, 2048)):
            sweep.append({"block_d": block_d, "segment": segment,
                          "fwd_ms": bench_ms(lambda: fwd(block_d, segment)),
                          "bwd_ms": bench_ms(lambda: bwd(block_d, segment))})
    return {"shape": {"batch": batch, "dim": dim, "seqlen": seqlen, "width": width, "dtype": dtype,
                      "layout": "channel-first", "bias": True, "activation": "silu"},
            "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes}, "rows": rows, "sweep": sweep,
            "target": {"fwd_ms": 0.08, "fwdbwd_ms": 0.25}}
