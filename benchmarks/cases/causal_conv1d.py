"""Causal depthwise conv1d fwd / fwd+bwd (PERFORMANCE.md): x [8, 4096, 2048] bf16 (channel-first),
width 4, bias, silu. Our Triton and CUDA kernels against the torch composition (``F.conv1d`` with
padding w - 1 and groups = dim, truncated, then silu; eager and torch.compile) and, where its CUDA
extension was built, the causal-conv1d package, in the same process.

Bytes (bf16): forward reads x and writes out (2 elements a position); the backward reads x and dout
and writes dx (3 more). ``TBps`` rows are those bytes over the time (the copy ceiling, measured by
run.py in the same run, is the bound). ``channel_last`` times both backends with x, out, dout and dx
stored [b, l, d];
``sweep`` (``run.py --sweeps``) times other Triton tiles (dims x positions a tile, warps).
"""

from __future__ import annotations

import peers
from common import TBps, autograd_row, bench_ms, optional_row, peak_GiB

from paddlenlp_fused.kernels.cuda import causal_conv1d as CK
from paddlenlp_fused.kernels.cuda import library
from paddlenlp_fused.kernels.triton import causal_conv1d as TK
from paddlenlp_fused.testing.numerics import rel_err

# The defaults (kernels/triton/causal_conv1d.py ``tiles``: forward 1 x 2048 positions, 4 warps;
# backward 1 x 1024, 2 warps) won the H200 sweep of this session's device round A; the runners-up
# and the previous defaults stay timed here.
TRITON_FWD_SWEEP = [dict(block_d=2, block_l=1024, num_warps=4), dict(block_d=4, block_l=512, num_warps=4)]
CUDA_PEER = "causal-conv1d CUDA"
TRITON_BWD_SWEEP = [dict(block_d=1, block_l=2048, num_warps=4), dict(block_d=2, block_l=1024, num_warps=4)]


def run(provider, quick: bool = False, sweep: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    batch, dim, seqlen, width = (2, 1024, 2048, 4) if quick else (8, 4096, 2048, 4)
    dtype, esize = "bfloat16", 2
    shape = (batch, dim, seqlen)
    x, dout = provider.randn(shape, dtype), provider.randn(shape, dtype)
    weight, bias = provider.randn((dim, width), dtype, scale=0.5), provider.randn((dim,), dtype)
    out, dx = provider.empty(shape, dtype), provider.empty(shape, dtype)
    dw, db = provider.zeros((dim, width), "float32"), provider.zeros((dim,), "float32")
    backends = {"paddlenlp_fused/triton": TK}
    if library.load()[0] is not None:
        backends["paddlenlp_fused/cuda"] = CK

    def timings(K, xx, yy=out, gg=dout, dxx=dx, **tile):
        """fwd, bwd, fwd+bwd closures on input xx, output yy, gradient gg and dx dxx (Triton tile overrides)."""

        def fwd():
            K.causal_conv1d_fwd(xx, weight, yy, bias, activation="silu", **tile)

        def bwd():
            dw.zero_()
            db.zero_()
            K.causal_conv1d_bwd(xx, weight, gg, dxx, dw, bias, db, activation="silu", **tile)

        def fwdbwd():
            fwd()
            bwd()

        return fwd, bwd, fwdbwd

    def fwdbwd_alloc(K):
        o, g = provider.empty(shape, dtype), provider.empty(shape, dtype)
        gw, gb = provider.zeros((dim, width), "float32"), provider.zeros((dim,), "float32")
        K.causal_conv1d_fwd(x, weight, o, bias, activation="silu")
        K.causal_conv1d_bwd(x, weight, dout, g, gw, bias, gb, activation="silu")
        return o, g, gw, gb

    def torch_conv(xx, ww, bb):
        return F.silu(F.conv1d(xx, ww[:, None, :], bb, padding=width - 1, groups=dim)[..., :seqlen])

    with torch.no_grad():
        ref = torch_conv(x.double(), weight.double(), bias.double()).cpu().numpy()
    grad_bytes = batch * dim * seqlen * esize  # dx (dweight, dbias are negligible)
    rows = []
    for impl, K in backends.items():
        fwd, bwd, fwdbwd = timings(K, x)
        fwd()
        provider.synchronize()
        rows.append({"impl": impl, "fwd_ms": bench_ms(fwd), "fwdbwd_ms": bench_ms(fwdbwd), "bwd_ms": bench_ms(bwd),
                     "peak_GiB": peak_GiB(provider, lambda K=K: fwdbwd_alloc(K), exclude_bytes=grad_bytes),
                     "rel_err": rel_err(out.double().cpu().numpy(), ref)})

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, weight, bias)]
    skipped = {}

    def deterministic_row():  # the deterministic backward: per-program partial sums, fixed-order sum
        work = provider.empty(TK.bwd_workspace_shape(x, weight), "float32")
        fwd, bwd = timings(TK, x)[0], timings(TK, x, workspace=work)[1]
        return {"impl": "paddlenlp_fused/triton deterministic", "fwd_ms": bench_ms(fwd),
                "fwdbwd_ms": bench_ms(lambda: (fwd(), bwd())), "bwd_ms": bench_ms(bwd),
                "rel_err": rel_err(out.double().cpu().numpy(), ref)}

    optional_row(rows, skipped, "paddlenlp_fused/triton deterministic", deterministic_row)

    def check(y, grads):
        return {"rel_err": rel_err(y.double().cpu().numpy(), ref)}

    rows.append(autograd_row(provider, "torch", lambda: torch_conv(*leaves), leaves, dout, check))
    torch_row = rows[-1]
    compiled = torch.compile(torch_conv)
    optional_row(rows, skipped, "torch.compile", lambda: autograd_row(
        provider, "torch.compile", lambda: compiled(*leaves), leaves, dout, check))

    def cuda_peer():  # only where causal-conv1d's CUDA extension was built (README: "Peers")
        fn = peers.load("causal_conv1d.causal_conv1d_interface").causal_conv1d_fn
        return dict(autograd_row(provider, CUDA_PEER, lambda: fn(*leaves, activation="silu"),
                                 leaves, dout, check), peer=peers.describe("causal_conv1d"))

    optional_row(rows, skipped, CUDA_PEER, cuda_peer)
    del ref, leaves

    fwd_bytes = 2 * batch * dim * seqlen * esize
    fwdbwd_bytes = 5 * batch * dim * seqlen * esize
    for row in rows:
        row["fwd_TBps"] = TBps(fwd_bytes, row["fwd_ms"])
        row["fwdbwd_TBps"] = TBps(fwdbwd_bytes, row["fwdbwd_ms"])
        row["speedup_vs_torch"] = torch_row["fwdbwd_ms"] / row["fwdbwd_ms"]

    # channel-last x, out, dout, dx (stored [b, l, d]) on both backends
    x_last, dout_last = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (x, dout))
    out_last, dx_last = torch.empty_like(x_last), torch.empty_like(x_last)
    channel_last = []
    for impl, K in backends.items():
        fwd, bwd, _ = timings(K, x_last, out_last, dout_last, dx_last)
        channel_last.append({"impl": impl, "fwd_ms": bench_ms(fwd), "bwd_ms": bench_ms(bwd)})
        print(f"channel-last {impl}: fwd {channel_last[-1]['fwd_ms']:.4f} ms, bwd {channel_last[-1]['bwd_ms']:.4f} ms")

    tiles = []
    if sweep and not quick:
        for tile in TRITON_FWD_SWEEP:
            fwd = timings(TK, x, **tile)[0]
            tiles.append({"pass": "fwd", **tile, "ms": bench_ms(fwd)})
            print(f"triton sweep {tiles[-1]}")
        for tile in TRITON_BWD_SWEEP:
            bwd = timings(TK, x, **tile)[1]
            tiles.append({"pass": "bwd", **tile, "ms": bench_ms(bwd)})
            print(f"triton sweep {tiles[-1]}")
    return {"shape": {"batch": batch, "dim": dim, "seqlen": seqlen, "width": width, "dtype": dtype,
                      "layout": "channel-first", "bias": True, "activation": "silu"},
            "bytes": {"fwd": fwd_bytes, "fwdbwd": fwdbwd_bytes}, "rows": rows, "skipped": skipped,
            "channel_last": channel_last,
            "sweep": tiles, "target": {"fwd_ms": 0.08, "fwdbwd_ms": 0.25}}
