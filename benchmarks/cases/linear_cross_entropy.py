"""Linear + cross-entropy fwd+bwd, T=8192 tokens, D=4096, V=128256, bf16, loss + grads of hidden and
weight [V, D] (PERFORMANCE.md), every path of ours beside torch and its peers in one process:

- ``lean`` (``max_workspace_gib="lean"``, and the op's path where the bounded one does not apply):
  cuBLASLt GEMMs on [Tb, Vc] chunks of fp32 logits (in the
  backward the bf16 gradient written over them), Triton softmax work, 4 GEMMs, workspace flat in T
  and V; the op's label check (one flag read) and its host read of the gradient scale included; one
  row without the flag read prices it; one row with smaller token blocks in the backward (more passes
  over dW, a larger vocabulary chunk);
- ``bounded`` (the op's default on the GPU, within 1 GiB; or ``max_workspace_gib`` given): [Tb, V]
  logits blocks fitting the bound, gradients in the forward pass (3 GEMMs), dW in bf16 or
  accumulated into an existing fp32 buffer (main_grad);
- ``triton``: the all-Triton fallback (no cuBLAS), exact and with the gradient filter;
- torch (logits in bf16, fp32 cross-entropy), torch chunked 8 x 1024 tokens with gradients in the
  forward and the CE compiled, Liger's fused linear CE and Apple's CCE when importable.

Each path runs through the same launchers as the Paddle op, allocating its workspaces inside, so the
peak memory is the op's (above inputs, weights and their gradients). FLOPs: one logits GEMM is
2 T D V; ``fwdbwd_TFLOPs`` counts the GEMMs a path executes, ``TFLOPs_3gemm`` the 6 T D V floor.
Errors: mean loss relative to an fp32 reference, dh and dW by relative norm (and the worst element
relative to the reference's largest). Inputs: hidden ~ N(0, 1), weight ~ N(0, 0.02^2) (logits of
std ~1.3), uniform labels, mean loss. Then memory (and time) at V=32000 and V=256000, and T=32768.
"""

from __future__ import annotations

import functools

import peers
from common import GiB, TFLOPs, bench_ms, peak_GiB

from paddlenlp_fused.kernels.triton import linear_cross_entropy as K

BOUND_GiB = 1.0


class _Gemm:
    """cuBLASLt GEMM with a workspace allocated per call (as the op does, from the caching allocator)."""

    def __init__(self, provider):
        from paddlenlp_fused.kernels.cuda import fused_dense
        from paddlenlp_fused.kernels.cuda import gemm as cuda_gemm

        self.provider, self.fn = provider, cuda_gemm.gemm
        self.bytes = fused_dense.workspace_bytes(0)

    def bound(self, nbytes=None):
        n = min(self.bytes, nbytes or self.bytes)
        return functools.partial(self.fn, workspace=self.provider.empty((n,), "uint8"))


def _lean(provider, gemm, h, w, labels, backward_plan=None, with_grads=True, check_labels=True):
    torch = provider.torch
    n_tok, D = h.shape
    V = w.shape[0]
    plan = K.lean_plan(n_tok, V, D, "bfloat16", backward=False)
    g = gemm.bound(plan.workspace)
    logits = torch.empty(K.lean_workspace(plan, D)["logits"][0], dtype=torch.float32, device=h.device)
    state, stats = torch.empty((4, n_tok), device=h.device), torch.empty((3, n_tok), device=h.device)
    loss_tok = torch.empty((n_tok,), device=h.device)
    flag = torch.full((1,), -100, dtype=torch.int64, device=h.device)
    K.lean_forward(g, h, w, labels, None, logits, state, stats, plan=plan)
    K.token_loss(stats, labels, loss_tok, flag, vocab_total=V)
    if check_labels:
        assert int(flag) == -100  # the op's one host read of the label flag
    del logits, state, g
    valid = (labels != -100).float()
    loss = loss_tok.sum() / valid.sum().clamp(min=1)
    if not with_grads:
        return loss, None, None
    lse = stats[0].contiguous()
    scale = float(1.0 / valid.sum().clamp(min=1))  # the op reads its gradient scale once
    plan = backward_plan or K.lean_plan(n_tok, V, D, "bfloat16", backward=True)
    shapes = K.lean_workspace(plan, D)
    g = gemm.bound(plan.workspace)
    logits = torch.empty(shapes["logits"][0], dtype=torch.float32, device=h.device)
    dh_acc = torch.empty(shapes["dh_acc"][0], dtype=torch.float32, device=h.device)
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    K.lean_backward(g, h, w, labels, None, lse, valid, valid, scale, dh, dw, None, logits, dh_acc, None, plan=plan)
    return loss, dh, dw


def _bounded(provider, gemm, h, w, labels, bound_gib=BOUND_GiB, dw_fp32=None):
    """Loss and gradients in the forward pass; ``dw_fp32``: an existing fp32 gradient buffer that dW
    is accumulated into (else a fresh bf16 dW)."""
    torch = provider.torch
    n_tok, D = h.shape
    V = w.shape[0]
    plan = K.bounded_plan(n_tok, V, "bfloat16", int(bound_gib * GiB) - 32 * n_tok)  # as the op plans it
    g = gemm.bound(plan.workspace)
    logits = torch.empty((plan.tokens, plan.ld), dtype=h.dtype, device=h.device)
    stats = torch.empty((3, plan.tokens), device=h.device)
    loss_tok = torch.empty((n_tok,), device=h.device)
    flag = torch.full((1,), -100, dtype=torch.int64, device=h.device)
    valid = (labels != -100)
    n_valid = max(int(valid.sum()), 1)  # the op's host read (with the flag's)
    dh = torch.empty_like(h)
    dw = torch.empty_like(w) if dw_fp32 is None else dw_fp32
    K.bounded_forward(g, h, w, labels, None, logits, stats, loss_tok, flag, dh, dw, None, plan=plan,
                      alpha=1.0 / n_valid, accumulate_dw=dw_fp32 is not None)
    assert int(flag) == -100
    loss = loss_tok.sum() / n_valid
    return loss, dh, dw


def _triton(provider, h, w, labels, filter_eps=None, with_grads=True):
    torch = provider.torch
    n_tok, D = h.shape
    V = w.shape[0]
    n_split = K.forward_splits(n_tok, V, "bfloat16")
    partials, stats = torch.empty((4, n_split, n_tok), device=h.device), torch.empty((3, n_tok), device=h.device)
    loss_tok = torch.empty((n_tok,), device=h.device)
    flag = torch.full((1,), -100, dtype=torch.int64, device=h.device)
    K.lse_forward(h, w, labels, None, partials, stats)
    K.token_loss(stats, labels, loss_tok, flag, vocab_total=V)
    assert int(flag) == -100
    del partials
    valid = (labels != -100).float()
    loss = loss_tok.sum() / valid.sum().clamp(min=1)
    if not with_grads:
        return loss, None, None
    lse = stats[0].contiguous()
    scale = (1.0 / valid.sum().clamp(min=1)).reshape(1)
    ws = K.backward_workspace(n_tok, D, V, "bfloat16")
    dh, dw = torch.empty_like(h), torch.empty_like(w)
    gw = torch.empty(ws.g, dtype=h.dtype, device=h.device)
    lo = torch.empty(ws.lo, dtype=h.dtype, device=h.device)
    flags = torch.empty(ws.flags, dtype=torch.int8, device=h.device)
    K.lce_backward(h, w, labels, None, lse, valid, valid, scale, dh, dw, None, gw, lo, flags, None,
                   filter_eps=filter_eps)
    return loss, dh, dw


def _torch_composition(h, w, labels):
    import torch.nn.functional as F

    return F.cross_entropy((h @ w.T).float(), labels)


def _torch_chunked(torch, chunks):
    """Chunks of tokens; each chunk's logits, fp32 CE (compiled) and gradients in the forward pass."""
    @torch.compile(dynamic=False)
    def ce_grad(logits, labels, scale):
        x = logits.float()
        lse = torch.logsumexp(x, dim=1)
        loss = (lse - x.gather(1, labels[:, None])[:, 0]).sum()
        g = torch.softmax(x, dim=1)
        g = g - torch.nn.functional.one_hot(labels, x.shape[1]).to(g.dtype)
        return loss, (g * scale).to(logits.dtype)

    def run(h, w, labels):
        n = h.shape[0]
        step = n // chunks
        dh, dw = torch.empty_like(h), torch.zeros_like(w)
        total = torch.zeros((), device=h.device)
        for i in range(chunks):
            hc, lc = h[i * step:(i + 1) * step], labels[i * step:(i + 1) * step]
            loss, g = ce_grad(hc @ w.T, lc, 1.0 / n)
            total += loss
            dh[i * step:(i + 1) * step] = g @ w
            dw.addmm_(g.T, hc)
        return total / n, dh, dw
    return run


def _reference_fp32(provider, h, w, labels):
    """fp32 loss, dh, dW (no TF32) with the logits materialised."""
    torch = provider.torch
    torch.backends.cuda.matmul.allow_tf32 = False
    hf, wf = h.float(), w.float()
    logits = hf @ wf.T
    lse = torch.logsumexp(logits, dim=1)
    loss = (lse - logits.gather(1, labels[:, None])[:, 0]).mean()
    g = torch.softmax(logits, dim=1)
    del logits
    g[torch.arange(len(labels), device=h.device), labels] -= 1.0
    g /= len(labels)
    return loss, g @ wf, g.T @ hf


def _inputs(provider, n_tok, D, V):
    torch = provider.torch
    h = provider.randn((n_tok, D), "bfloat16")
    w = provider.randn((V, D), "bfloat16", scale=0.02)
    labels = torch.randint(0, V, (n_tok,), device=provider.device)
    return h, w, labels


def _peers(skipped: dict):
    """(name, fn(h, w, labels) -> (loss, dh, dw), source) of the peers that load here (from the pinned
    files in .whl, see peers.py); the others go into ``skipped`` with the reason."""
    out = []
    try:
        liger = peers.load("liger_kernel.ops.fused_linear_cross_entropy").LigerFusedLinearCrossEntropyFunction

        def liger_run(h, w, labels):
            hg, wg = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
            loss = liger.apply(hg, wg, labels)[0]  # (loss, z_loss, token accuracy)
            loss.backward()
            return loss, hg.grad, wg.grad
        out.append(("Liger FLCE", liger_run, peers.describe("liger_kernel")))
    except Exception as exc:  # a missing or broken peer never fails the run
        skipped["Liger FLCE"] = repr(exc)[:300]
    try:
        cce = peers.load("cut_cross_entropy.linear_cross_entropy").linear_cross_entropy

        def cce_run(h, w, labels):
            hg, wg = h.detach().requires_grad_(True), w.detach().requires_grad_(True)
            loss = cce(hg, wg, labels)
            loss.backward()
            return loss, hg.grad, wg.grad
        out.append(("Apple CCE (filter_eps default)", cce_run, peers.describe("cut_cross_entropy")))
    except Exception as exc:
        skipped["Apple CCE (filter_eps default)"] = repr(exc)[:300]
    for name, reason in skipped.items():
        print(f"{name} unavailable: {reason}", flush=True)
    return out


def run(provider, quick: bool = False) -> dict:
    torch = provider.torch
    n_tok, D, V = (2048, 4096, 32000) if quick else (8192, 4096, 128256)
    h, w, labels = _inputs(provider, n_tok, D, V)
    grad_bytes = (h.numel() + w.numel()) * 2
    gemm_flops = 2 * n_tok * D * V
    gemm = _Gemm(provider)

    ref_loss, ref_dh, ref_dw = _reference_fp32(provider, h, w, labels)
    ref_loss = float(ref_loss)

    def rel(x, ref):
        d = (x.double() - ref.double())
        return float(torch.linalg.vector_norm(d) / torch.linalg.vector_norm(ref.double()))

    def errors(loss, dh, dw):
        out = {"rel_err": abs(float(loss.detach()) - ref_loss) / abs(ref_loss),
               "dh_rel_err": rel(dh, ref_dh), "dw_rel_err": rel(dw, ref_dw),
               "dh_max_err": float((dh.float() - ref_dh).abs().max() / ref_dh.abs().max()),
               "dw_max_err": float((dw.float() - ref_dw).abs().max() / ref_dw.abs().max())}
        return out

    # the plain bf16 composition's own gradient error, the scale of DESIGN's bf16 bound (2x it, < 1e-2)
    rows = []

    def add(name, fn, gemms, fwd=None, excl=grad_bytes, prep=None, leaves=(), **extra):
        fn()  # compile / warm
        provider.synchronize()
        row = {"impl": name}
        if fwd is not None:
            row["fwd_ms"] = bench_ms(fwd)
        row["fwdbwd_ms"] = bench_ms(fn)
        row["peak_GiB"] = peak_GiB(provider, fn, excl, leaves)  # leaves: gradients freed before the baseline
        if prep is not None:
            prep()
        row.update(errors(*fn()))
        row["gemms"] = gemms
        row["fwdbwd_TFLOPs"] = TFLOPs(gemms * gemm_flops, row["fwdbwd_ms"])
        row["TFLOPs_3gemm"] = TFLOPs(3 * gemm_flops, row["fwdbwd_ms"])
        row.update(extra)
        rows.append(row)
        print(row, flush=True)

    lean_plans = {"lean": None, "lean backward Tb=2048 Vc=8192": K.lean_plan(n_tok, V, D, "bfloat16", backward=True,
                                                                          tokens=2048, vocab=8192)}
    for name, plan in lean_plans.items():
        label = "paddlenlp_fused/cuda " + name
        add(label, lambda p=plan: _lean(provider, gemm, h, w, labels, p), 4,
            fwd=lambda p=plan: _lean(provider, gemm, h, w, labels, p, with_grads=False),
            plan=[list(K.lean_plan(n_tok, V, D, "bfloat16", backward=False)),
                  list(plan or K.lean_plan(n_tok, V, D, "bfloat16", backward=True))])
    rows[0]["fwdbwd_ms_without_label_flag_read"] = bench_ms(
        lambda: _lean(provider, gemm, h, w, labels, check_labels=False))

    add(f"paddlenlp_fused/cuda bounded {BOUND_GiB:g} GiB, bf16 dW",
        lambda: _bounded(provider, gemm, h, w, labels), 3,
        plan=list(K.bounded_plan(n_tok, V, "bfloat16", int(BOUND_GiB * GiB) - 32 * n_tok)))
    add("paddlenlp_fused/cuda bounded 2 GiB, bf16 dW", lambda: _bounded(provider, gemm, h, w, labels, 2.0), 3)
    main_grad = torch.zeros((V, D), dtype=torch.float32, device=h.device)
    add(f"paddlenlp_fused/cuda bounded {BOUND_GiB:g} GiB, dW into fp32 main_grad",
        lambda: _bounded(provider, gemm, h, w, labels, dw_fp32=main_grad), 3, excl=h.numel() * 2,
        prep=lambda: main_grad.zero_())

    add("paddlenlp_fused/triton", lambda: _triton(provider, h, w, labels), 4,
        fwd=lambda: _triton(provider, h, w, labels, with_grads=False))
    add("paddlenlp_fused/triton filter_eps=2^-12 (approximate)",
        lambda: _triton(provider, h, w, labels, filter_eps=K.AUTO_FILTER_EPS["bfloat16"]), 4)

    hg, wg = h.detach().clone().requires_grad_(True), w.detach().clone().requires_grad_(True)

    def torch_fwdbwd():
        hg.grad = wg.grad = None
        loss = _torch_composition(hg, wg, labels)
        loss.backward()
        return loss, hg.grad, wg.grad

    def torch_fwd():
        with torch.no_grad():
            return _torch_composition(hg, wg, labels)

    add("torch", torch_fwdbwd, 3, fwd=torch_fwd, leaves=(hg, wg))
    chunked = _torch_chunked(torch, 8)
    add("torch chunked 8x1024, grads in fwd, CE compiled", lambda: chunked(h, w, labels), 3)
    skipped = {}
    for name, fn, source in _peers(skipped):
        try:
            add(name, lambda f=fn: f(h, w, labels), 4 if "Liger" not in name else 3, peer=source)
        except Exception as exc:  # a peer that loads but fails to run is recorded, not fatal
            skipped[name] = repr(exc)[:300]
            print(f"{name} failed: {exc!r}", flush=True)

    scaling = []
    sizes = ((8192, 32000), (8192, 256000), (32768, 128256)) if not quick else ((2048, 8000), (2048, 64000))
    del ref_dh, ref_dw
    for nt, v in sizes:
        hv, wv, lv = _inputs(provider, nt, D, v)
        gb = (hv.numel() + wv.numel()) * 2
        entry = {"T": nt, "D": D, "V": v}
        for key, fn in (("lean", lambda: _lean(provider, gemm, hv, wv, lv)),
                        ("bounded_1GiB", lambda: _bounded(provider, gemm, hv, wv, lv))):
            fn()
            entry[f"{key}_peak_GiB"] = peak_GiB(provider, fn, gb)
            entry[f"{key}_fwdbwd_ms"] = bench_ms(fn, rep_ms=100)
        hv.requires_grad_(True)
        wv.requires_grad_(True)

        def torch_once():
            hv.grad = wv.grad = None
            loss = _torch_composition(hv, wv, lv)
            loss.backward()
            return loss, hv.grad, wv.grad

        entry["torch_peak_GiB"] = peak_GiB(provider, torch_once, gb, leaves=(hv, wv))
        scaling.append(entry)
        print(entry, flush=True)
        del hv, wv, lv

    return {"shape": {"T": n_tok, "D": D, "V": V, "dtype": "bfloat16"},
            "flops_per_gemm": gemm_flops, "rows": rows, "skipped": skipped, "memory_scaling": scaling,
            "target": {"lean_fwdbwd_ms": 52.0, "lean_stretch_ms": 48.0, "lean_peak_GiB": 0.1,
                       "bounded_fwdbwd_ms": 40.0, "bounded_peak_GiB": 1.0},
            "notes": "rel_err: mean loss against fp32; dh/dw_rel_err by relative norm, *_max_err the worst element "
                     "over the reference's largest; peak_GiB above inputs, weights and their gradients "
                     f"({GiB} bytes a GiB; the fp32 main_grad row: above the pre-existing main_grad and dh); "
                     "gemms: the T x D x V GEMMs a path executes."}
