"""MLP fwd+bwd (PERFORMANCE.md): x [16384, 4096] -> 16384 (gelu tanh) -> 4096 with biases, bf16; our
cuBLASLt-epilogue and Triton kernels against the torch composition (F.linear, gelu tanh, F.linear)
in the same process. Plus the LLaMA-8B SwiGLU MLP 4096 -> 14336 -> 4096 (no biases) against torch.

Ours run the sequence ``fused_mlp_func`` runs at checkpoint_lvl 0, on the launchers directly:
    fwd   out1, pre = gelu(x @ W1 + b1) [GELU_AUX_BIAS]; out = out1 @ W2 + b2 [BIAS]
    bwd   dW2, db2 = out1^T @ dy [BGRADA]; dact = dy @ W2^T; dpre = gelu'(pre) * dact (Triton,
          elementwise); dW1, db1 = x^T @ dpre [BGRADA]; dx = dpre @ W1^T
(``per_gemm_ms`` times each GEMM with and without its epilogue; DGELU_BGRAD was slower than the
plain GEMM plus the elementwise backward, see ops/fused_dense.py.)
torch computes the same gradients (x, both weights and biases) with autograd.
FLOPs: 2 GEMMs of 2*M*D*H forward, 4 backward: 12*M*D*H for fwd+bwd (13.2 TFLOP; 16.8 ms at the
787 TFLOP/s ceiling). The cuBLASLt ``heuristic`` indices 0..3 are swept (``heuristic_sweep``).
"""

from __future__ import annotations

from common import CEILING, TFLOPs, bench_ms, peak_GiB

from paddlenlp_fused.kernels.cuda import fused_dense as lt
from paddlenlp_fused.kernels.triton import fused_dense as tr
from paddlenlp_fused.kernels.triton.gated_activation import gated_activation_bwd, gated_activation_fwd
from paddlenlp_fused.testing.numerics import rel_err

GRAD_NAMES = ("dx", "dweight1", "dbias1", "dweight2", "dbias2")


def _rel(a, b) -> float:
    return rel_err(a.double().cpu().numpy(), b.double().cpu().numpy())


def _errors(outs, refs):
    """rel_err of the output, and the largest over the gradients present."""
    grads = [_rel(o, r) for o, r in zip(outs[1:], refs[1:]) if o is not None]
    return _rel(outs[0], refs[0]), max(grads)


def _gelu_mlp(provider, torch, F, M, D, H, sweep):
    dtype = "bfloat16"
    x = provider.randn((M, D), dtype)
    w1, b1 = provider.randn((D, H), dtype, scale=D**-0.5), provider.randn((H,), dtype, scale=0.1)
    w2, b2 = provider.randn((H, D), dtype, scale=H**-0.5), provider.randn((D,), dtype, scale=0.1)
    dy = provider.randn((M, D), dtype)
    ws = provider.empty((lt.workspace_bytes(0),), "uint8")
    aux_shape, _ = lt.aux_shape("gelu_approx", M, H)
    grad_bytes = 2 * (M * D + 2 * D * H + H + D)

    def buffers():
        e = provider.empty
        return dict(out1=e((M, H), dtype), aux=e(aux_shape, dtype), out=e((M, D), dtype), dw2=e((H, D), dtype),
                    db2=e((D,), dtype), dact=e((M, H), dtype), dpre=e((M, H), dtype), db1=e((H,), dtype),
                    dw1=e((D, H), dtype), dx=e((M, D), dtype))

    def cuda_fwd(b, h):
        lt.linear_act_fwd(x, w1, b["out1"], ws, bias=b1, activation="gelu_approx", aux=b["aux"], heuristic=h)
        lt.linear_act_fwd(b["out1"], w2, b["out"], ws, bias=b2, heuristic=h)

    def cuda_fwdbwd(b, h):
        cuda_fwd(b, h)
        lt.linear_wgrad(b["out1"], dy, b["dw2"], ws, dbias=b["db2"], heuristic=h)
        lt.linear_act_fwd(dy, w2, b["dact"], ws, weight_transposed=True, heuristic=h)
        tr.act_bwd(b["aux"], b["dact"], b["dpre"], "gelu_approx")
        lt.linear_wgrad(x, b["dpre"], b["dw1"], ws, dbias=b["db1"], heuristic=h)
        lt.linear_act_fwd(b["dpre"], w1, b["dx"], ws, weight_transposed=True, heuristic=h)

    def triton_fwd(b):
        tr.gemm(x, w1, b["out1"], bias=b1, activation="gelu_approx", pre=b["aux"][:, :H])
        tr.gemm(b["out1"], w2, b["out"], bias=b2)

    def triton_fwdbwd(b):
        triton_fwd(b)
        tr.gemm(b["out1"], dy, b["dw2"], dbias=b["db2"], trans_a=True)
        tr.gemm(dy, w2, b["dpre"], activation="gelu_approx", pre=b["aux"][:, :H], act_grad=True, trans_b=True)
        tr.gemm(x, b["dpre"], b["dw1"], dbias=b["db1"], trans_a=True)
        tr.gemm(b["dpre"], w1, b["dx"], trans_b=True)

    # torch: weights in its [out, in] layout, leaves with gradients
    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w1.t().contiguous(), b1, w2.t().contiguous(), b2)]
    tx, tw1, tb1, tw2, tb2 = leaves

    def torch_forward():
        return F.linear(F.gelu(F.linear(tx, tw1, tb1), approximate="tanh"), tw2, tb2)

    def torch_fwd():
        with torch.no_grad():
            return torch_forward()

    def torch_fwdbwd():
        for t in leaves:
            t.grad = None
        torch_forward().backward(dy)
        return [t.grad for t in leaves]

    # fp32-on-upcast reference of the output and every gradient
    ref_leaves = [t.detach().float().requires_grad_(True) for t in leaves]
    rx, rw1, rb1, rw2, rb2 = ref_leaves
    ref_out = F.linear(F.gelu(F.linear(rx, rw1, rb1), approximate="tanh"), rw2, rb2)
    ref_out.backward(dy.float())
    refs = [ref_out.detach(), rx.grad, rw1.grad.t(), rb1.grad, rw2.grad.t(), rb2.grad]
    del ref_out, ref_leaves, rx, rw1, rb1, rw2, rb2
    fwd_flops, fwdbwd_flops = 4 * M * D * H, 12 * M * D * H

    def row(impl, fwd, fwdbwd, outs, alloc_fwdbwd):
        fwd_ms, fwdbwd_ms = bench_ms(fwd), bench_ms(fwdbwd)
        out_err, grad_err = _errors(outs, refs)
        return {"impl": impl, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
                "peak_GiB": peak_GiB(provider, alloc_fwdbwd, exclude_bytes=grad_bytes), "rel_err": out_err,
                "grad_rel_err": grad_err, "fwd_TFLOPs": TFLOPs(fwd_flops, fwd_ms),
                "fwdbwd_TFLOPs": TFLOPs(fwdbwd_flops, fwdbwd_ms)}

    b = buffers()
    sweep_ms = {}
    for h in sweep:
        cuda_fwdbwd(b, h)
        provider.synchronize()
        sweep_ms[h] = bench_ms(lambda h=h: cuda_fwdbwd(b, h))
    best = min(sweep_ms, key=sweep_ms.get)
    auto = lt.AUTO_HEURISTIC
    cuda_fwdbwd(b, auto)
    provider.synchronize()
    cuda_outs = [b["out"], b["dx"], b["dw1"], b["db1"], b["dw2"], b["db2"]]
    rows = [row(f"paddlenlp_fused/cuda (heuristic {auto})", lambda: cuda_fwd(b, auto), lambda: cuda_fwdbwd(b, auto),
                cuda_outs, lambda: cuda_fwdbwd(buffers(), auto))]
    triton_fwdbwd(b)  # autotunes every GEMM once, outside the timing
    provider.synchronize()
    rows.append(row("paddlenlp_fused/triton", lambda: triton_fwd(b), lambda: triton_fwdbwd(b),
                    [b["out"], b["dx"], b["dw1"], b["db1"], b["dw2"], b["db2"]], lambda: triton_fwdbwd(buffers())))
    torch_fwdbwd()
    grads = torch_fwdbwd()
    torch_outs = [torch_fwd(), grads[0], grads[1].t(), grads[2], grads[3].t(), grads[4]]
    rows.append(row("torch", torch_fwd, torch_fwdbwd, torch_outs, torch_fwdbwd))
    torch_ms = rows[-1]["fwdbwd_ms"]
    for r in rows:
        r["speedup_vs_torch"] = torch_ms / r["fwdbwd_ms"]
    return rows, {str(h): ms for h, ms in sweep_ms.items()}, best


def _swiglu_mlp(provider, torch, F, M, D, H, heuristic):
    """LLaMA-8B MLP: down(silu(gate(x)) * up(x)), fused gate|up weight [D, 2H], no biases."""
    dtype = "bfloat16"
    x = provider.randn((M, D), dtype)
    w1, w2 = provider.randn((D, 2 * H), dtype, scale=D**-0.5), provider.randn((H, D), dtype, scale=H**-0.5)
    dy = provider.randn((M, D), dtype)
    ws = provider.empty((lt.workspace_bytes(0),), "uint8")
    e = provider.empty
    b = dict(h=e((M, 2 * H), dtype), out1=e((M, H), dtype), out=e((M, D), dtype), dw2=e((H, D), dtype),
             dact=e((M, H), dtype), dh=e((M, 2 * H), dtype), dw1=e((D, 2 * H), dtype), dx=e((M, D), dtype))

    def fwd():
        lt.linear_act_fwd(x, w1, b["h"], ws, heuristic=heuristic)
        gated_activation_fwd(b["h"], b["out1"], "silu")
        lt.linear_act_fwd(b["out1"], w2, b["out"], ws, heuristic=heuristic)

    def fwdbwd():
        fwd()
        lt.linear_wgrad(b["out1"], dy, b["dw2"], ws, heuristic=heuristic)
        lt.linear_act_fwd(dy, w2, b["dact"], ws, weight_transposed=True, heuristic=heuristic)
        gated_activation_bwd(b["h"], b["dact"], b["dh"], "silu")
        lt.linear_wgrad(x, b["dh"], b["dw1"], ws, heuristic=heuristic)
        lt.linear_act_fwd(b["dh"], w1, b["dx"], ws, weight_transposed=True, heuristic=heuristic)

    leaves = [t.detach().clone().requires_grad_(True) for t in (x, w1.t().contiguous(), w2.t().contiguous())]
    tx, tw1, tw2 = leaves

    def torch_forward():
        gate, up = F.linear(tx, tw1).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, tw2)

    def torch_fwd():
        with torch.no_grad():
            return torch_forward()

    def torch_fwdbwd():
        for t in leaves:
            t.grad = None
        torch_forward().backward(dy)

    fwdbwd()
    provider.synchronize()
    gate, up = F.linear(x.float(), w1.float().t()).chunk(2, dim=-1)
    ref = F.linear(F.silu(gate) * up, w2.float().t())
    del gate, up
    flops = 2 * M * D * 3 * H
    rows = []
    for impl, f, fb, out in (("paddlenlp_fused/cuda", fwd, fwdbwd, b["out"]),
                             ("torch", torch_fwd, torch_fwdbwd, None)):
        fwd_ms, fwdbwd_ms = bench_ms(f), bench_ms(fb)
        rows.append({"impl": impl, "fwd_ms": fwd_ms, "fwdbwd_ms": fwdbwd_ms,
                     "rel_err": _rel(out if out is not None else torch_fwd(), ref),
                     "fwd_TFLOPs": TFLOPs(flops, fwd_ms), "fwdbwd_TFLOPs": TFLOPs(3 * flops, fwdbwd_ms)})
    for r in rows:
        r["speedup_vs_torch"] = rows[-1]["fwdbwd_ms"] / r["fwdbwd_ms"]
    return rows


def gemm_breakdown(provider, M=16384, D=4096, H=16384, heuristic=0) -> dict:
    """Milliseconds of each GEMM of the fwd+bwd, ours with its cuBLASLt epilogue and without it, and
    torch's product of the same shape in its own layout (F.linear / mm, which runs the bias add in
    cuBLASLt's epilogue too): where the time goes."""
    import torch.nn.functional as F

    dtype = "bfloat16"
    r = provider.randn
    x, w1, b1, w2, b2 = r((M, D), dtype), r((D, H), dtype), r((H,), dtype), r((H, D), dtype), r((D,), dtype)
    out1, aux, dy, dpre = r((M, H), dtype), r((M, H), dtype), r((M, D), dtype), r((M, H), dtype)
    ws = provider.empty((lt.workspace_bytes(0),), "uint8")
    e = provider.empty
    o_mh, o_md, o_dh, o_hd = e((M, H), dtype), e((M, D), dtype), e((D, H), dtype), e((H, D), dtype)
    db_h, db_d = e((H,), dtype), e((D,), dtype)
    w1t, w2t = w1.t().contiguous(), w2.t().contiguous()
    kw = dict(heuristic=heuristic)
    cases = {
        "fwd1 x@W1 (+b1, GELU_AUX)": (
            lambda: lt.linear_act_fwd(x, w1, o_mh, ws, bias=b1, activation="gelu_approx", aux=aux, **kw),
            lambda: lt.linear_act_fwd(x, w1, o_mh, ws, **kw), lambda: F.linear(x, w1t, b1)),
        "fwd2 out1@W2 (+b2)": (lambda: lt.linear_act_fwd(out1, w2, o_md, ws, bias=b2, **kw),
                               lambda: lt.linear_act_fwd(out1, w2, o_md, ws, **kw), lambda: F.linear(out1, w2t, b2)),
        "wgrad2 out1^T@dy (BGRAD)": (lambda: lt.linear_wgrad(out1, dy, o_hd, ws, dbias=db_d, **kw),
                                     lambda: lt.linear_wgrad(out1, dy, o_hd, ws, **kw), lambda: dy.t() @ out1),
        "dgrad2 dy@W2^T (DGELU_BGRAD)": (
            lambda: lt.linear_act_bwd(dy, w2, aux, o_mh, ws, dbias=db_h, activation="gelu_approx", **kw),
            lambda: lt.linear_act_fwd(dy, w2, o_mh, ws, weight_transposed=True, **kw), lambda: dy @ w2t),
        "wgrad1 x^T@dpre": (None, lambda: lt.linear_wgrad(x, dpre, o_dh, ws, **kw), lambda: dpre.t() @ x),
        "dgrad1 dpre@W1^T": (None, lambda: lt.linear_act_fwd(dpre, w1, o_md, ws, weight_transposed=True, **kw),
                             lambda: dpre @ w1t),
    }
    result = {}
    for name, (fused, plain, ref) in cases.items():
        result[name] = {"fused_ms": bench_ms(fused) if fused else None, "plain_ms": bench_ms(plain),
                        "torch_ms": bench_ms(ref)}
    return result


def run(provider, quick: bool = False) -> dict:
    import torch
    import torch.nn.functional as F

    M = 2048 if quick else 16384
    D, H = 4096, 16384
    rows, sweep, best = _gelu_mlp(provider, torch, F, M, D, H, sweep=range(4))
    torch.cuda.empty_cache()
    swiglu = _swiglu_mlp(provider, torch, F, M, 4096, 14336, lt.AUTO_HEURISTIC)
    return {"shape": {"M": M, "in": D, "hidden": H, "out": D, "activation": "gelu_approx", "bias": True,
                      "dtype": "bfloat16"},
            "flops": {"fwd": 4 * M * D * H, "fwdbwd": 12 * M * D * H},
            "rows": rows,
            "heuristic_sweep": {"fwdbwd_ms": sweep, "best": best, "auto": lt.AUTO_HEURISTIC},
            "per_gemm_ms": gemm_breakdown(provider, M, D, H, lt.AUTO_HEURISTIC),
            "llama8b_swiglu": {"shape": {"M": M, "in": 4096, "hidden": 14336, "out": 4096, "activation": "swiglu",
                                         "bias": False, "dtype": "bfloat16"}, "rows": swiglu},
            "target": {"fwdbwd_ms": 18.5, "speedup_vs_torch": 1.1, "floor_ms": 16.8,
                       "ceiling_TFLOPs": CEILING["bf16_gemm_TFLOPs"]}}
